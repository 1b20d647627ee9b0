//! What the benchmarks in `benches/benches/` share: where the llama.cpp anchors and the
//! requantised model files live, running a measurement in a child process (thread counts are
//! read once per process) and reading resident memory.
//!
//! Run the benchmarks with `cargo bench -p meshnet-benches`; `benches/README.md` has one
//! command per table.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// The variable naming the folder `benches/anchors/llamacpp.sh` builds llama.cpp in.
pub const ANCHORS_VARIABLE: &str = "MESHNET_ANCHORS";

/// The variable naming the folder `benches/anchors/quantized_files.sh` writes its files to.
pub const QUANTIZED_VARIABLE: &str = "MESHNET_QUANTIZED";

/// The formats `benches/anchors/quantized_files.sh` makes of the default model by default.
pub const QUANTIZED_TYPES: [&str; 5] = ["Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"];

/// The name the default model's file has without its format and extension.
const DEFAULT_MODEL_STEM: &str = "SmolLM2-135M-Instruct";

/// The folder `benches/anchors/llamacpp.sh` builds in: `$MESHNET_ANCHORS`, or
/// `~/.cache/meshnet/anchors` (as the script has it).
pub fn anchors_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os(ANCHORS_VARIABLE).filter(|d| !d.is_empty()) {
        return dir.into();
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| ".".into());
    Path::new(&home).join(".cache/meshnet/anchors")
}

/// The llama.cpp program `name` (`llama-bench`, `llama-batched-bench`, ...) when
/// `benches/anchors/llamacpp.sh` has built it.
pub fn llamacpp_binary(name: &str) -> Option<PathBuf> {
    let binary = anchors_dir().join("llama.cpp/build/bin").join(name);
    binary.is_file().then_some(binary)
}

/// The folder of the requantised copies of the default model: `$MESHNET_QUANTIZED`, or
/// `quantized/` in `models_dir` (as `benches/anchors/quantized_files.sh` has it).
pub fn quantized_dir(models_dir: &Path) -> PathBuf {
    std::env::var_os(QUANTIZED_VARIABLE)
        .filter(|d| !d.is_empty())
        .map_or_else(|| models_dir.join("quantized"), PathBuf::from)
}

/// Where `benches/anchors/quantized_files.sh` puts the default model in `format` (`Q4_K_M`).
pub fn quantized_file(models_dir: &Path, format: &str) -> PathBuf {
    quantized_dir(models_dir).join(format!("{DEFAULT_MODEL_STEM}.{format}.gguf"))
}

/// A `kB` field of this process's `/proc/self/status`, in bytes (0 where there is none).
fn status_field(status: &str, field: &str) -> u64 {
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map_or(0, |kb| kb * 1024)
}

/// Resident set size of this process in bytes (0 where `/proc` is missing).
pub fn resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status_field(&status, "VmRSS:")
}

/// The most this process has had resident so far, in bytes (0 where `/proc` is missing).
pub fn peak_resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status_field(&status, "VmHWM:")
}

/// Bytes as MiB.
pub fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// The median of `values` (the mean of the middle two for an even count; NaN when empty).
pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// A command running this benchmark binary again with `flag` (its worker mode) and `threads`
/// compute threads (rayon's and candle's pools read their size once per process).
pub fn worker_command(flag: &str, threads: usize) -> std::io::Result<Command> {
    let mut command = Command::new(std::env::current_exe()?);
    command
        .arg(flag)
        .env("RAYON_NUM_THREADS", threads.to_string())
        .env("CANDLE_NUM_THREADS", threads.to_string());
    Ok(command)
}

/// What a finished child process left.
#[derive(Debug, Clone)]
pub struct Finished {
    /// Its standard output.
    pub stdout: String,
    /// The most it had resident, in bytes, as last seen while it ran (0 when never seen).
    pub peak_resident: u64,
}

/// Runs `command` to the end, watching its peak resident memory (`VmHWM`, read every 20 ms
/// while it runs: a process's peak is usually reached well before it exits). Returns its
/// output when it succeeds, else [`failure_message`] of what it wrote to standard error.
pub fn run_watched(command: &mut Command) -> Result<Finished, String> {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|error| format!("could not start {command:?}: {error}"))?;
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let status_path = format!("/proc/{}/status", child.id());
    let mut peak_resident = 0;
    let status = loop {
        if let Ok(status) = std::fs::read_to_string(&status_path) {
            peak_resident = peak_resident.max(status_field(&status, "VmHWM:"));
        }
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(error) => return Err(format!("could not wait for {command:?}: {error}")),
        }
    };
    let stdout = stdout.join().unwrap_or_default();
    let stderr = stderr.join().unwrap_or_default();
    if status.success() {
        Ok(Finished {
            stdout,
            peak_resident,
        })
    } else {
        Err(failure_message(&stderr, &status.to_string()))
    }
}

/// Reads a child's pipe to the end on a thread of its own, so neither pipe fills up.
fn drain<R: Read + Send + 'static>(pipe: Option<R>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(mut pipe) = pipe {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            text = String::from_utf8_lossy(&bytes).into_owned();
        }
        text
    })
}

/// The gist of a failed child's standard error, on one line: a panic's message, else the last
/// `error:` line (without that word), else the last line written (else `status`).
pub fn failure_message(stderr: &str, status: &str) -> String {
    let lines: Vec<&str> = stderr.lines().map(str::trim).collect();
    if let Some(at) = lines.iter().position(|line| line.contains("panicked at")) {
        let message: Vec<&str> = lines[at + 1..]
            .iter()
            .take_while(|line| !line.starts_with("note:") && !line.starts_with("stack backtrace"))
            .copied()
            .filter(|line| !line.is_empty())
            .collect();
        if !message.is_empty() {
            return format!("panic: {}", message.join(" "));
        }
        return lines[at].to_string();
    }
    if let Some(line) = lines.iter().rev().find(|line| line.starts_with("error")) {
        return line.strip_prefix("error: ").unwrap_or(line).to_string();
    }
    lines
        .iter()
        .rev()
        .find(|line| !line.is_empty())
        .map_or_else(|| status.to_string(), |line| (*line).to_string())
}

/// The whitespace-separated numbers of the last line of `text`.
pub fn last_line_numbers(text: &str) -> Result<Vec<f64>, String> {
    let line = text.lines().last().unwrap_or_default();
    line.split_whitespace()
        .map(|word| {
            word.parse::<f64>()
                .map_err(|_| format!("expected numbers, read {line:?}"))
        })
        .collect()
}

/// `ours / anchor` with two decimals, `-` when either is missing.
pub fn ratio(ours: Option<f64>, anchor: Option<f64>) -> String {
    match (ours, anchor) {
        (Some(ours), Some(anchor)) if anchor > 0.0 => format!("{:.2}", ours / anchor),
        _ => "-".into(),
    }
}

/// A rate with one decimal, `-` when missing.
pub fn rate(value: Option<f64>) -> String {
    value.map_or_else(|| "-".into(), |value| format!("{value:.1}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn failure_messages() {
        let panic = "thread 'main' panicked at crates/x.rs:1:2:\nQ6_K has no AVX2 body\n\
                     note: run with `RUST_BACKTRACE=1`";
        assert_eq!(failure_message(panic, "1"), "panic: Q6_K has no AVX2 body");
        assert_eq!(
            failure_message("loading\nerror: unsupported tensor type\n", "1"),
            "unsupported tensor type"
        );
        assert_eq!(failure_message("", "exit status: 3"), "exit status: 3");
    }

    #[test]
    fn numbers() {
        assert_eq!(last_line_numbers("x\n1 2.5\n"), Ok(vec![1.0, 2.5]));
        assert!(last_line_numbers("1 x").is_err());
    }
}

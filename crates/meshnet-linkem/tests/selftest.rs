//! The `meshnet-linkem` binary as a user runs it.

#![allow(clippy::unwrap_used)]

use std::process::{Command, Output};

fn linkem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_meshnet-linkem"))
        .args(args)
        .output()
        .unwrap()
}

/// The number after `measured ` on the line starting with `label`.
fn measured(stdout: &str, label: &str) -> f64 {
    let line = stdout
        .lines()
        .find(|line| line.starts_with(label))
        .unwrap_or_else(|| panic!("no {label:?} line in {stdout:?}"));
    let figure = line.split("measured ").nth(1).unwrap();
    figure.split(' ').next().unwrap().parse().unwrap()
}

#[test]
fn selftest_measures_the_setting_within_ten_percent() {
    // 50 ms each way: the 10% bound leaves 10 ms of round trip for a busy machine's scheduling.
    let output = linkem(&["selftest", "--delay-ms", "50", "--rate-kbit", "20000"]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{stdout}");
    assert!(
        output.status.success(),
        "stdout: {stdout}\nstderr: {stderr}"
    );
    let rtt_ms = measured(&stdout, "rtt:");
    let kbit = measured(&stdout, "throughput:");
    assert!((90.0..=110.0).contains(&rtt_ms), "rtt {rtt_ms} ms");
    assert!(
        (18_000.0..=22_000.0).contains(&kbit),
        "throughput {kbit} kbit/s"
    );
}

#[test]
fn bad_arguments_are_named_and_fail_without_a_panic() {
    let cases: [(&[&str], &str); 5] = [
        (
            &["relay", "--listen", "nowhere", "--to", "127.0.0.1:1"],
            "--listen",
        ),
        (&["relay", "--listen", "127.0.0.1:0"], "--to"),
        (&["relay", "--link", "127.0.0.1:0"], "LISTEN=TARGET"),
        (
            &[
                "relay",
                "--listen",
                "127.0.0.1:0",
                "--to",
                "127.0.0.1:1",
                "--burst-kb",
                "4",
            ],
            "--rate-kbit",
        ),
        (&["selftest", "--rate-kbit", "0"], "--rate-kbit"),
    ];
    for (args, named) in cases {
        let output = linkem(args);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(named), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

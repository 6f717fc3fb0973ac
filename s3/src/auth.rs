//! The keys file of `--s3-keys`: one `ACCESS_KEY_ID SECRET` a line
//! (blank lines and lines starting with `#` are skipped), readable by its
//! owner only (mode 0600 or stricter), as a token file is.

use arbor_node::{Error, Result};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// The (access key id, secret) pairs of keys file `path`, checked.
pub fn load(path: &Path) -> Result<Vec<(String, String)>> {
    let shown = path.display();
    let meta = std::fs::metadata(path).map_err(|e| Error::Invalid(format!("--s3-keys {shown}: {e}")))?;
    if !meta.is_file() {
        return Err(Error::Invalid(format!("--s3-keys {shown}: not a file")));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(Error::Invalid(format!(
            "--s3-keys {shown}: readable by others (mode {mode:04o}); it holds secret keys: chmod 600 {shown}"
        )));
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::Invalid(format!("--s3-keys {shown}: {e}")))?;
    parse(&text).map_err(|e| Error::Invalid(format!("--s3-keys {shown}: {e}")))
}

fn parse(text: &str) -> std::result::Result<Vec<(String, String)>, String> {
    let mut keys: Vec<(String, String)> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut words = line.split_whitespace();
        let (Some(id), Some(secret), None) = (words.next(), words.next(), words.next()) else {
            return Err(format!("line {}: expected ACCESS_KEY_ID SECRET", i + 1));
        };
        if keys.iter().any(|(k, _)| k == id) {
            return Err(format!("line {}: access key {id} given twice", i + 1));
        }
        keys.push((id.to_string(), secret.to_string()));
    }
    if keys.is_empty() {
        return Err("no keys (one ACCESS_KEY_ID SECRET a line)".into());
    }
    Ok(keys)
}

/// SigV4 (and SigV2) credentials for the service: the keys file's.
pub fn simple_auth(keys: &[(String, String)]) -> s3s::auth::SimpleAuth {
    let mut auth = s3s::auth::SimpleAuth::new();
    for (id, secret) in keys {
        auth.register(id.clone(), secret.as_str().into());
    }
    auth
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn keys_files_parse_and_loose_modes_are_refused() {
        assert_eq!(
            parse("# team keys\nAK1 secret1\n\n  AK2   s2  \n").expect("parse"),
            vec![("AK1".into(), "secret1".into()), ("AK2".into(), "s2".into())]
        );
        assert!(parse("AK1\n").is_err());
        assert!(parse("AK1 a b\n").is_err());
        assert!(parse("AK1 a\nAK1 b\n").is_err());
        assert!(parse("\n# none\n").is_err());
        let dir = std::env::temp_dir().join(format!("arbor-s3-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let f = dir.join("keys");
        std::fs::write(&f, "AK secret\n").expect("write");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let e = load(&f).expect_err("0644 refused").to_string();
        assert!(e.contains("chmod 600"), "{e}");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        assert_eq!(load(&f).expect("0600 taken"), vec![("AK".into(), "secret".into())]);
        std::fs::remove_dir_all(&dir).expect("rm");
    }
}

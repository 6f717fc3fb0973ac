//! Keys of a root in strict byte order, from the files and folders.
//!
//! A folder walk in name order is not key order: key `a-b` (a file) sorts
//! before `a/b` (a file in folder `a`) since `-` < `/`, but name `a-b`
//! sorts after name `a`. So the entries of each folder are ordered by the
//! key they begin: a file's name, a folder's name followed by `/`. Every
//! key under folder `a` starts with `a/`, so ordering the entries that way
//! and walking depth first gives every key in byte order.
//!
//! A walk starts after a key (a continuation token or `StartAfter`) by
//! skipping the folders whose keys all come before it, and under a prefix
//! by entering only the folders whose keys may start with it.

use crate::store::{s3_err, Tree, HIDDEN};
use arbor_engine::volume::{Attr, FileKind, ROOT_INO};
use s3s::{S3ErrorCode, S3Result};

/// One key found.
pub struct Found {
    pub key: Vec<u8>,
    pub attr: Attr,
}

struct Child {
    /// The key it begins: its name, and `/` after a folder's.
    sort: Vec<u8>,
    ino: u64,
    kind: FileKind,
}

struct Frame {
    /// The keys in this folder start with it (`a/b/`; empty at the root).
    dir_key: Vec<u8>,
    children: Vec<Child>,
    next: usize,
}

/// The keys of a root after `after` that start with `prefix`, in byte order.
pub struct Walk<'a> {
    tree: &'a Tree,
    prefix: Vec<u8>,
    after: Vec<u8>,
    stack: Vec<Frame>,
}

impl<'a> Walk<'a> {
    pub fn new(tree: &'a Tree, prefix: &[u8], after: &[u8]) -> S3Result<Walk<'a>> {
        let mut w = Walk { tree, prefix: prefix.to_vec(), after: after.to_vec(), stack: Vec::new() };
        w.enter(ROOT_INO, Vec::new())?;
        Ok(w)
    }

    fn enter(&mut self, ino: u64, dir_key: Vec<u8>) -> S3Result<()> {
        let mut children: Vec<Child> = Vec::new();
        for e in self.tree.entries(ino)? {
            if dir_key.is_empty() && e.name == HIDDEN {
                continue;
            }
            // Keys are UTF-8: a name that is not has no key.
            if std::str::from_utf8(&e.name).is_err() {
                continue;
            }
            let mut sort = e.name;
            match e.kind {
                FileKind::Directory => sort.push(b'/'),
                FileKind::Regular => {}
                // Links, devices, sockets, pipes: not objects.
                _ => continue,
            }
            children.push(Child { sort, ino: e.ino, kind: e.kind });
        }
        children.sort_unstable_by(|a, b| a.sort.cmp(&b.sort));
        self.stack.push(Frame { dir_key, children, next: 0 });
        Ok(())
    }

    /// Leaves the folder whose keys start with `dir_key` (and what the
    /// walk entered under it), if it is being walked: its keys are one
    /// common prefix.
    pub fn skip_folder(&mut self, dir_key: &[u8]) {
        if let Some(i) = self.stack.iter().position(|f| f.dir_key == dir_key) {
            self.stack.truncate(i);
        }
    }

    pub fn next_key(&mut self) -> S3Result<Option<Found>> {
        loop {
            let Some(top) = self.stack.last_mut() else { return Ok(None) };
            let Some(c) = top.children.get(top.next) else {
                self.stack.pop();
                continue;
            };
            top.next += 1;
            let mut key = top.dir_key.clone();
            key.extend_from_slice(&c.sort);
            let (ino, kind) = (c.ino, c.kind);
            if kind == FileKind::Directory {
                // Every key under it starts with `key`.
                if !(key.starts_with(&self.prefix) || self.prefix.starts_with(&key)) {
                    continue;
                }
                if key <= self.after && !self.after.starts_with(&key) {
                    continue;
                }
                // A folder a DELETE pruned since its parent was read is
                // gone, with every key under it: skipped.
                match self.enter(ino, key.clone()) {
                    Err(e) if *e.code() == S3ErrorCode::NoSuchKey => continue,
                    r => r?,
                }
                if key > self.after && key.starts_with(&self.prefix) && self.tree.is_marked(ino)? {
                    match self.tree.files.getattr(ino) {
                        Ok(attr) => return Ok(Some(Found { key, attr })),
                        Err(e) if e.errno() == libc::ENOENT => continue,
                        Err(e) => return Err(s3_err(e, "getattr")),
                    }
                }
                continue;
            }
            if key <= self.after || !key.starts_with(&self.prefix) {
                continue;
            }
            match self.tree.files.getattr(ino) {
                Ok(attr) => return Ok(Some(Found { key, attr })),
                // Deleted since the folder was read.
                Err(e) if e.errno() == libc::ENOENT => continue,
                Err(e) => return Err(s3_err(e, "getattr")),
            }
        }
    }
}

/// An entry of a listing page.
pub enum Entry {
    Object(Found),
    Prefix(Vec<u8>),
}

/// One page of a listing.
pub struct Page {
    pub entries: Vec<Entry>,
    pub truncated: bool,
}

/// Where a page starts: after a key, or after every key that starts with
/// a common prefix (the last thing the page before listed).
pub fn start_after(token: Option<&str>, start_after: Option<&str>) -> S3Result<Vec<u8>> {
    let from_token = match token {
        Some(t) => Some(
            decode_token(t)
                .ok_or_else(|| s3s::s3_error!(InvalidArgument, "the continuation token is not one this server gave"))?,
        ),
        None => None,
    };
    let sa = start_after.map(|s| s.as_bytes().to_vec()).unwrap_or_default();
    Ok(match from_token {
        Some(t) if t > sa => t,
        _ => sa,
    })
}

/// The token of a page that ended at `e`.
pub fn token_after(e: &Entry) -> String {
    match e {
        Entry::Object(f) => format!("k{}", crate::store::hex(&f.key)),
        Entry::Prefix(p) => format!("p{}", crate::store::hex(p)),
    }
}

/// The key a token names, for a walk to start after: a common prefix
/// with 0xFF after it, which no UTF-8 key holds, so that every key under
/// it is skipped too.
fn decode_token(t: &str) -> Option<Vec<u8>> {
    let (kind, rest) = t.split_at_checked(1)?;
    let mut key = crate::store::unhex(rest)?;
    match kind {
        "k" => {}
        "p" => key.push(0xff),
        _ => return None,
    }
    Some(key)
}

/// Lists up to `max` keys and common prefixes after `after`.
pub fn page(tree: &Tree, prefix: &str, delimiter: Option<&str>, after: &[u8], max: usize) -> S3Result<Page> {
    let prefix = prefix.as_bytes();
    let delim = delimiter.filter(|d| !d.is_empty()).map(str::as_bytes);
    let mut walk = Walk::new(tree, prefix, after)?;
    let mut entries = Vec::new();
    let mut last_prefix: Option<Vec<u8>> = None;
    loop {
        let Some(f) = walk.next_key()? else { return Ok(Page { entries, truncated: false }) };
        let common = delim.and_then(|d| {
            let rest = &f.key[prefix.len()..];
            find(rest, d).map(|i| f.key[..prefix.len() + i + d.len()].to_vec())
        });
        if let Some(cp) = common {
            if last_prefix.as_deref() == Some(&cp) {
                continue;
            }
            if entries.len() == max {
                return Ok(Page { entries, truncated: true });
            }
            // With `/`, the prefix is a folder: nothing more under it.
            if cp.ends_with(b"/") {
                walk.skip_folder(&cp);
            }
            last_prefix = Some(cp.clone());
            entries.push(Entry::Prefix(cp));
            continue;
        }
        if entries.len() == max {
            return Ok(Page { entries, truncated: true });
        }
        entries.push(Entry::Object(f));
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{parse_key, Meta};
    use arbor_engine::device::SimDevice;
    use arbor_engine::env::TestEnv;
    use arbor_engine::volume::{Config, Volume};
    use std::sync::Arc;

    fn tree_with(keys: &[&str]) -> Tree {
        let cfg = Config { commit_interval: None, env: TestEnv::new(1), ..Config::default() };
        let vol = Volume::open(Arc::new(SimDevice::new()), cfg).expect("volume");
        let tree = Tree::new(vol);
        for k in keys {
            let key = parse_key(k).expect("key");
            if key.folder {
                tree.put_folder(&key, k, false).expect("folder");
                continue;
            }
            let (dir, name, ino) = tree.temp_file().expect("temp");
            tree.files.write(ino, 0, k.as_bytes()).expect("write");
            tree.label(ino, &crate::store::md5_hex(k.as_bytes()), &Meta::default()).expect("label");
            tree.place(dir, &name, ino, &key, k, &crate::store::Onto::Any).expect("place");
        }
        tree
    }

    fn keys_of(p: &Page) -> Vec<String> {
        p.entries
            .iter()
            .map(|e| match e {
                Entry::Object(f) => String::from_utf8(f.key.clone()).expect("utf8"),
                Entry::Prefix(p) => format!("[{}]", String::from_utf8(p.clone()).expect("utf8")),
            })
            .collect()
    }

    /// Every page of a listing, joined.
    fn all_pages(tree: &Tree, prefix: &str, delim: Option<&str>, max: usize) -> Vec<String> {
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let after = start_after(token.as_deref(), None).expect("token");
            let p = page(tree, prefix, delim, &after, max).expect("page");
            out.extend(keys_of(&p));
            if !p.truncated {
                return out;
            }
            token = p.entries.last().map(token_after);
        }
    }

    #[test]
    fn a_walk_gives_keys_in_byte_order_across_folders() {
        let keys = ["a/b", "a-b", "a/b-c/d", "a.b/c", "a0", "a!", "b", "m/", "m/x", "a/b.c", "a /z", "a/b/"];
        // "a/b" and "a/b/" cannot both be: the folder marker is refused.
        let tree = tree_with(&keys[..11]);
        let mut want: Vec<String> = keys[..11].iter().map(|s| s.to_string()).collect();
        want.sort();
        assert_eq!(all_pages(&tree, "", None, 1000), want);
        for max in 1..4 {
            assert_eq!(all_pages(&tree, "", None, max), want, "{max} a page");
        }
        // Common prefixes, and paging across them.
        let want_delim = ["a /", "a!", "a-b", "a.b/", "a/", "a0", "b", "m/"];
        for max in [1, 2, 3, 1000] {
            let got = all_pages(&tree, "", Some("/"), max);
            let got: Vec<String> =
                got.iter().map(|k| k.trim_start_matches('[').trim_end_matches(']').to_string()).collect();
            assert_eq!(got, want_delim, "{max} a page");
        }
        assert_eq!(all_pages(&tree, "a/", Some("/"), 1000), ["a/b", "[a/b-c/]", "a/b.c"]);
        assert_eq!(all_pages(&tree, "a/b", None, 1000), ["a/b", "a/b-c/d", "a/b.c"]);
        assert_eq!(all_pages(&tree, "m", None, 1), ["m/", "m/x"]);
        assert_eq!(all_pages(&tree, "zz", None, 10), Vec::<String>::new());
        // StartAfter inside a folder.
        let p = page(&tree, "", None, b"a/b-", 2).expect("page");
        assert_eq!(keys_of(&p), ["a/b-c/d", "a/b.c"]);
        // The hidden folder is never listed.
        tree.hidden(&[b"tmp"]).expect("hidden");
        assert_eq!(all_pages(&tree, "", None, 1000), want);
    }

    #[test]
    fn tokens_round_trip_and_a_prefix_token_skips_its_keys() {
        let f = Entry::Prefix(b"a/".to_vec());
        let t = token_after(&f);
        let after = start_after(Some(&t), None).expect("token");
        assert!(b"a/zzz".as_slice() < after.as_slice());
        assert!(b"a0".as_slice() > after.as_slice());
        assert!(start_after(Some("zz"), None).is_err());
        assert_eq!(start_after(None, Some("b")).expect("sa"), b"b");
        assert_eq!(find(b"a-b/c", b"/"), Some(3));
        assert_eq!(find(b"abc", b"bc"), Some(1));
    }
}

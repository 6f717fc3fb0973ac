//! Questions about committed roots, asked without opening a volume: what
//! changed between two roots, and which segments a root needs.

use super::commit::{features, read_commit};
use super::keys;
use super::nodes::Nodes;
use super::txn::{Reads, View};
use super::types::{DirEntry, Extent, FileKind, Inode, Piece, ROOT_INO};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::format::{decode_value, Addr, SegId};
use crate::tree::{self, Leaf, Node, Tree};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChangeKind {
    Added,
    Removed,
    Modified,
}

/// One path that differs between two roots.
#[derive(Clone, Debug, PartialEq)]
pub struct Change {
    pub path: String,
    pub kind: ChangeKind,
    pub file_kind: FileKind,
    pub size_before: Option<u64>,
    pub size_after: Option<u64>,
}

fn nodes(device: Arc<dyn Device>) -> Nodes {
    Nodes::new(device, 256 << 20)
}

/// The tree root a commit record names.
pub fn root_of(device: &dyn Device, commit: Addr) -> Result<Addr> {
    Ok(read_commit(device, commit)?.record.root)
}

/// Paths in one tree, each directory's worked out once per diff.
struct Paths<'a> {
    view: &'a View<'a>,
    dirs: HashMap<u64, Option<String>>,
    /// Every recorded name is a live link ([`features::NAMES_EXACT`]).
    names_exact: bool,
}

impl<'a> Paths<'a> {
    fn new(view: &'a View<'a>, features: u64) -> Paths<'a> {
        Paths { view, dirs: HashMap::new(), names_exact: features & features::NAMES_EXACT != 0 }
    }

    /// The path of directory `ino`, or `None` if it is gone. A directory has
    /// exactly one name, which mkdir and rename keep in its inode, so its
    /// path is read up the parent chain without looking names up.
    fn dir(&mut self, ino: u64) -> Result<Option<String>> {
        let mut chain = Vec::new();
        let mut at = ino;
        let mut base = loop {
            if at == ROOT_INO {
                break Some(String::new());
            }
            if let Some(p) = self.dirs.get(&at) {
                break p.clone();
            }
            if chain.len() > 4096 {
                return Err(Error::corrupted("directory parent chain", ino));
            }
            match self.view.try_inode(at)? {
                Some(i) if i.kind == FileKind::Directory => {
                    chain.push((at, i.name));
                    at = i.parent;
                }
                _ => break None,
            }
        };
        for (dir, name) in chain.into_iter().rev() {
            base = base.map(|b| join(&b, &name));
            self.dirs.insert(dir, base.clone());
        }
        Ok(base)
    }

    /// The path of `ino`, whose inode is `i`, through its recorded name. On
    /// a tree that does not promise exact names (one written before link
    /// names were kept) a file's name is checked against its directory, as
    /// removing that link while others remained left it stale; then the
    /// path is `<inode N>`. A file with no links left has no path.
    fn of(&mut self, ino: u64, i: &Inode) -> Result<String> {
        let unknown = || format!("<inode {ino}>");
        if i.kind == FileKind::Directory {
            return Ok(self.dir(ino)?.unwrap_or_else(unknown));
        }
        let live =
            i.nlink > 0 && (self.names_exact || self.view.entry(i.parent, &i.name)?.is_some_and(|e| e.ino == ino));
        if !live {
            return Ok(unknown());
        }
        Ok(self.dir(i.parent)?.map(|d| join(&d, &i.name)).unwrap_or_else(unknown))
    }
}

fn join(dir: &str, name: &[u8]) -> String {
    let name = String::from_utf8_lossy(name);
    if dir.is_empty() {
        name.into_owned()
    } else {
        format!("{dir}/{name}")
    }
}

/// What changed from the commit `from` to the commit `to`, by path. Work is
/// proportional to the changes: subtrees the roots share are skipped.
pub fn diff_commits(device: Arc<dyn Device>, from: Addr, to: Addr) -> Result<Vec<Change>> {
    diff_with(&nodes(device), from, to)
}

/// Reads committed roots through one node cache that lives as long as it
/// does: a catalog keeps one, so repeated diffs and GC marks reuse nodes.
pub struct Inspector {
    store: Nodes,
}

impl Inspector {
    pub fn new(device: Arc<dyn Device>) -> Inspector {
        Inspector { store: nodes(device) }
    }

    pub fn diff(&self, from: Addr, to: Addr) -> Result<Vec<Change>> {
        diff_with(&self.store, from, to)
    }

    pub fn reachable_segments(&self, commit: Addr, seen: &mut HashSet<Addr>, segs: &mut HashSet<SegId>) -> Result<()> {
        reachable_with(&self.store, commit, seen, segs)
    }
}

fn diff_with(store: &Nodes, from: Addr, to: Addr) -> Result<Vec<Change>> {
    let device = store.device.clone();
    let (ca, cb) = (read_commit(device.as_ref(), from)?, read_commit(device.as_ref(), to)?);
    let (ra, rb) = (ca.record.root, cb.record.root);
    let (ta, tb) = (Tree::from_root(ra), Tree::from_root(rb));
    let (va, vb) = (View { tree: &ta, store }, View { tree: &tb, store });
    // (parent, name, entry before, entry after)
    type EntryChange = (u64, Vec<u8>, Option<DirEntry>, Option<DirEntry>);
    let mut entries: Vec<EntryChange> = Vec::new();
    // Inodes whose keys differ, with the inode on each side when the diff
    // itself carried it.
    type Sides = (Option<Inode>, Option<Inode>);
    let mut touched: BTreeMap<u64, Option<Sides>> = BTreeMap::new();
    tree::diff(store, ra, rb, &mut |(k, old, new)| {
        match k.first() {
            Some(&keys::DIRENT) => {
                let dec = |v: Option<&[u8]>| v.map(|v| decode_value::<DirEntry>(v, "directory entry")).transpose();
                entries.push((keys::leading_u64(k), k[9..].to_vec(), dec(old)?, dec(new)?));
            }
            Some(&keys::INODE) => {
                let dec = |v: Option<&[u8]>| v.map(|v| decode_value::<Inode>(v, "inode")).transpose();
                touched.insert(keys::leading_u64(k), Some((dec(old)?, dec(new)?)));
            }
            Some(&keys::EXTENT) | Some(&keys::XATTR) => {
                touched.entry(keys::leading_u64(k)).or_insert(None);
            }
            _ => {}
        }
        Ok(())
    })?;
    let inodes = |ino: u64| -> Result<Sides> {
        match touched.get(&ino) {
            Some(Some(both)) => Ok(both.clone()),
            _ => Ok((va.try_inode(ino)?, vb.try_inode(ino)?)),
        }
    };
    let (mut paths_a, mut paths_b) = (Paths::new(&va, ca.features), Paths::new(&vb, cb.features));
    let mut out: BTreeMap<String, Change> = BTreeMap::new();
    let mut reported = HashSet::new();
    for (parent, name, old, new) in &entries {
        let size = |e: &Option<DirEntry>, after: bool| -> Result<Option<u64>> {
            let Some(e) = e else { return Ok(None) };
            let (a, b) = inodes(e.ino)?;
            Ok(if after { b } else { a }.map(|i| i.size))
        };
        let (kind, file_kind) = match (old, new) {
            (None, Some(n)) => (ChangeKind::Added, n.kind),
            (Some(o), None) => (ChangeKind::Removed, o.kind),
            (Some(_), Some(n)) => (ChangeKind::Modified, n.kind),
            (None, None) => continue,
        };
        let dir = if kind == ChangeKind::Removed { paths_a.dir(*parent)? } else { paths_b.dir(*parent)? };
        let dir = dir.unwrap_or_else(|| format!("<inode {parent}>"));
        // A name that now points at an inode covers that inode's changes; a
        // removed name does not (the inode may live on under another link).
        reported.extend(new.iter().map(|e| e.ino));
        let path = join(&dir, name);
        let (size_before, size_after) = (size(old, false)?, size(new, true)?);
        out.insert(path.clone(), Change { path, kind, file_kind, size_before, size_after });
    }
    for &ino in touched.keys() {
        if reported.contains(&ino) {
            continue;
        }
        let (Some(a), Some(b)) = inodes(ino)? else { continue };
        // Every write and attribute change sets the inode's ctime: extents
        // that differ under an identical inode were only moved (compaction).
        if b.kind == FileKind::Directory || a == b {
            continue;
        }
        let path = paths_b.of(ino, &b)?;
        out.insert(
            path.clone(),
            Change {
                path,
                kind: ChangeKind::Modified,
                file_kind: b.kind,
                size_before: Some(a.size),
                size_after: Some(b.size),
            },
        );
    }
    Ok(out.into_values().collect())
}

/// The log extents a leaf holds, with their keys: they sit together, every
/// extent key starting with the same tag. External extents (imported
/// files' objects) are in no segment and left out.
pub(super) fn leaf_extents(l: &Leaf) -> impl Iterator<Item = Result<(&[u8], Extent)>> + '_ {
    l.entries_from(l.lower_bound(&[keys::EXTENT])).take_while(|(k, _)| k.first() == Some(&keys::EXTENT)).filter_map(
        |(k, v)| match Piece::decode(v) {
            Ok(Piece::Log(e)) => Some(Ok((k, e))),
            Ok(Piece::Object(_)) => None,
            Err(e) => Some(Err(e)),
        },
    )
}

/// Adds to `segments` every segment the commit `commit` needs: its own, its
/// tree's nodes', and its files' data. Nodes already in `seen` (reached from
/// another root) are not walked again.
pub fn reachable_segments(
    device: Arc<dyn Device>,
    commit: Addr,
    seen: &mut HashSet<Addr>,
    segments: &mut HashSet<SegId>,
) -> Result<()> {
    reachable_with(&nodes(device), commit, seen, segments)
}

fn reachable_with(store: &Nodes, commit: Addr, seen: &mut HashSet<Addr>, segments: &mut HashSet<SegId>) -> Result<()> {
    segments.insert(commit.seg);
    let root = root_of(store.device.as_ref(), commit)?;
    tree::walk(store, root, seen, &mut |addr, node| {
        segments.insert(addr.seg);
        if let Node::Leaf(l) = node {
            for e in leaf_extents(l) {
                segments.insert(e?.1.data.seg);
            }
        }
        Ok(())
    })
}

/// Recounts, by walking the whole tree, the live bytes per segment of the
/// commit `commit`: what its commit record's table must say.
pub fn recount_live_bytes(device: Arc<dyn Device>, commit: Addr) -> Result<Vec<(SegId, u64)>> {
    let store = nodes(device.clone());
    let root = root_of(device.as_ref(), commit)?;
    let mut live: BTreeMap<SegId, u64> = BTreeMap::new();
    tree::walk(&store, root, &mut HashSet::new(), &mut |addr, node| {
        *live.entry(addr.seg).or_default() += addr.len as u64;
        if let Node::Leaf(l) = node {
            for e in leaf_extents(l) {
                let (_, e) = e?;
                *live.entry(e.data.seg).or_default() += e.len as u64;
            }
        }
        Ok(())
    })?;
    Ok(live.into_iter().collect())
}

/// The live-bytes table a commit record carries.
pub fn live_table_of(device: &dyn Device, commit: Addr) -> Result<Vec<(SegId, u64)>> {
    Ok(read_commit(device, commit)?.record.live)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::SimDevice;
    use crate::env::TestEnv;
    use crate::volume::txn::Txn;
    use crate::volume::{Config, RenameMode, Volume};
    use std::collections::BTreeSet;

    fn volume() -> (SimDevice, Arc<Volume>) {
        let dev = SimDevice::new();
        let cfg = Config { commit_interval: None, env: TestEnv::new(2), ..Config::default() };
        let vol = Volume::open(Arc::new(dev.clone()), cfg).expect("open");
        (dev, vol)
    }

    /// The diff between two commits, and its paths and kinds.
    fn changes(dev: SimDevice, before: Addr, after: Addr) -> (Vec<Change>, Vec<(String, ChangeKind)>) {
        let changes = diff_commits(Arc::new(dev), before, after).expect("diff");
        let summary = changes.iter().map(|c| (c.path.clone(), c.kind)).collect();
        (changes, summary)
    }

    #[test]
    fn diff_names_added_removed_and_modified_paths() {
        let (dev, vol) = volume();
        let data = vol.mkdir(ROOT_INO, b"data", 0o755, 0, 0).expect("mkdir").ino;
        for i in 0..200 {
            let f =
                vol.create(data, format!("shard-{i}").as_bytes(), libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
            vol.write(f, 0, &[1; 3000]).expect("write");
        }
        let keep = vol.create(ROOT_INO, b"config.yaml", libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
        vol.commit().expect("commit");
        let before = vol.last_commit().expect("commit");
        vol.write(keep, 0, b"lr: 0.1").expect("modify");
        let ckpt = vol.mkdir(ROOT_INO, b"ckpt", 0o755, 0, 0).expect("mkdir").ino;
        let w = vol.create(ckpt, b"step-100.pt", libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
        vol.write(w, 0, &[7; 10_000]).expect("write");
        vol.unlink(data, b"shard-5").expect("unlink");
        vol.rename(data, b"shard-6", data, b"renamed", RenameMode::Plain).expect("rename");
        vol.commit().expect("commit");
        let (changes, summary) = changes(dev, before, vol.last_commit().expect("commit"));
        assert_eq!(
            summary,
            vec![
                ("ckpt".into(), ChangeKind::Added),
                ("ckpt/step-100.pt".into(), ChangeKind::Added),
                ("config.yaml".into(), ChangeKind::Modified),
                ("data/renamed".into(), ChangeKind::Added),
                ("data/shard-5".into(), ChangeKind::Removed),
                ("data/shard-6".into(), ChangeKind::Removed),
            ]
        );
        let step = changes.iter().find(|c| c.path == "ckpt/step-100.pt").expect("step");
        assert_eq!((step.size_before, step.size_after), (None, Some(10_000)));
        let cfg_change = changes.iter().find(|c| c.path == "config.yaml").expect("config");
        assert_eq!((cfg_change.size_before, cfg_change.size_after), (Some(0), Some(7)));
    }

    #[test]
    fn diff_paths_follow_renamed_directories_and_the_links_a_file_keeps() {
        let (dev, vol) = volume();
        let mk = |p: u64, n: &[u8]| vol.mkdir(p, n, 0o755, 0, 0).expect("mkdir").ino;
        let file = |p: u64, n: &[u8]| vol.create(p, n, libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
        let (a, old) = (mk(ROOT_INO, b"a"), mk(ROOT_INO, b"old"));
        let b = mk(a, b"b");
        let big = file(b, b"big.bin");
        vol.write(big, 0, &[1; 100_000]).expect("write");
        let small = file(b, b"small.txt");
        let linked = file(a, b"first");
        vol.link(linked, old, b"second").expect("link");
        let gone = file(old, b"gone");
        vol.commit().expect("commit");
        let before = vol.last_commit().expect("commit");
        // A rename of a directory moves every path below it.
        vol.rename(ROOT_INO, b"a", ROOT_INO, b"renamed", RenameMode::Plain).expect("rename");
        vol.write(big, 50_000, &[2; 10]).expect("write extent");
        vol.write(small, 0, b"x").expect("write inline");
        // The newest link of `linked` goes: it is named by the one it keeps.
        vol.unlink(old, b"second").expect("unlink");
        vol.write(linked, 0, b"y").expect("write");
        vol.unlink(old, b"gone").expect("unlink");
        vol.rmdir(ROOT_INO, b"old").expect("rmdir");
        vol.commit().expect("commit");
        let (changes, summary) = changes(dev, before, vol.last_commit().expect("commit"));
        assert_eq!(
            summary,
            vec![
                ("a".into(), ChangeKind::Removed),
                ("old".into(), ChangeKind::Removed),
                ("old/gone".into(), ChangeKind::Removed),
                ("old/second".into(), ChangeKind::Removed),
                ("renamed".into(), ChangeKind::Added),
                ("renamed/b/big.bin".into(), ChangeKind::Modified),
                ("renamed/b/small.txt".into(), ChangeKind::Modified),
                ("renamed/first".into(), ChangeKind::Modified),
            ],
            "{changes:?}"
        );
        let big_change = changes.iter().find(|c| c.path == "renamed/b/big.bin").expect("big");
        assert_eq!((big_change.size_before, big_change.size_after), (Some(100_000), Some(100_000)));
        let _ = gone;
    }

    #[test]
    fn a_tree_made_from_empty_promises_exact_names_and_a_commit_passes_on_only_what_its_tree_had() {
        let (dev, vol) = volume();
        let bits = |at: Addr| read_commit(&dev, at).expect("commit").features;
        assert_eq!(bits(vol.last_commit().expect("commit")), features::NAMES_EXACT);
        vol.create(ROOT_INO, b"f", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
        vol.commit().expect("commit");
        assert_eq!(bits(vol.last_commit().expect("commit")), features::NAMES_EXACT);
        // A tree whose commit lacks the bit (one written by an older build)
        // never regains it, through commits and reopening.
        vol.state.write().features = 0;
        vol.create(ROOT_INO, b"g", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
        vol.commit().expect("commit");
        assert_eq!(bits(vol.last_commit().expect("commit")), 0);
        drop(vol);
        let cfg = Config { commit_interval: None, env: TestEnv::new(3), ..Config::default() };
        let vol = Volume::open(Arc::new(dev.clone()), cfg).expect("reopen");
        vol.create(ROOT_INO, b"h", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
        vol.commit().expect("commit");
        assert_eq!(bits(vol.last_commit().expect("commit")), 0);
    }

    /// A tree written before link names were kept may record a removed
    /// link as a file's name: there the diff checks names and prints
    /// `<inode N>` for a stale one rather than a path that is gone.
    #[test]
    fn diff_checks_names_on_a_tree_that_does_not_promise_them() {
        let (dev, vol) = volume();
        let (a, b) = (
            vol.mkdir(ROOT_INO, b"a", 0o755, 0, 0).expect("mkdir").ino,
            vol.mkdir(ROOT_INO, b"b", 0o755, 0, 0).expect("mkdir").ino,
        );
        let f = vol.create(a, b"first", libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
        vol.link(f, b, b"second").expect("link");
        vol.unlink(b, b"second").expect("unlink");
        let fsck = |vol: &Volume| {
            let mut report = crate::fsck::FsckReport::default();
            crate::fsck::check_files(vol, &mut report).expect("fsck");
            report.problems
        };
        assert_eq!(fsck(&vol), Vec::<String>::new());
        {
            // What an older build left: the removed link as the name.
            let mut st = vol.state.write();
            let mut i = vol.view(&st).inode(f).expect("inode");
            (i.parent, i.name) = (b, b"second".to_vec());
            Txn { tree: &mut st.tree, store: &vol.nodes }.put_inode(f, &i).expect("put");
        }
        // Where exact names are promised, fsck reports a stale one...
        assert_eq!(fsck(&vol).len(), 1, "{:?}", fsck(&vol));
        vol.state.write().features = 0;
        // ...and where they are not, a stale name is no problem.
        assert_eq!(fsck(&vol), Vec::<String>::new());
        vol.commit().expect("commit");
        let before = vol.last_commit().expect("commit");
        vol.write(f, 0, b"changed").expect("write");
        vol.commit().expect("commit");
        let (_, summary) = changes(dev, before, vol.last_commit().expect("commit"));
        assert_eq!(summary, vec![(format!("<inode {f}>"), ChangeKind::Modified)]);
    }

    /// Every file's recorded name is one of its links, and a file with
    /// several names keeps exactly those under its inode, whatever mix of
    /// link, unlink and rename (plain, over another file, exchange) made it.
    #[test]
    fn a_file_records_a_live_name_through_links_unlinks_and_renames() {
        let (_dev, vol) = volume();
        let dirs: Vec<u64> = [b"d0".as_slice(), b"d1", b"d2"]
            .iter()
            .map(|n| vol.mkdir(ROOT_INO, n, 0o755, 0, 0).expect("mkdir").ino)
            .collect();
        let names = [b"a".as_slice(), b"b", b"c", b"d"];
        let mut x = 99u64;
        let mut next = |n: usize| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 33) as usize % n
        };
        for step in 0..3000 {
            let (d, n) = (dirs[next(3)], names[next(4)]);
            let (d2, n2) = (dirs[next(3)], names[next(4)]);
            let _ = match next(6) {
                0 => vol.create(d, n, libc::S_IFREG | 0o644, 0, 0, 0).map(drop),
                1 => vol.lookup(d, n).and_then(|a| vol.link(a.ino, d2, n2)).map(drop),
                2 => vol.unlink(d, n),
                3 => vol.rename(d, n, d2, n2, RenameMode::Plain),
                4 => vol.rename(d, n, d2, n2, RenameMode::Exchange),
                _ => vol.lookup(d, n).and_then(|a| vol.link(a.ino, d, n2)).map(drop),
            };
            let st = vol.state.read();
            let v = vol.view(&st);
            let mut links: BTreeMap<u64, BTreeSet<(u64, Vec<u8>)>> = BTreeMap::new();
            for &d in &dirs {
                for k in v.keys_with_prefix(&keys::dirent_prefix(d)).expect("scan") {
                    let e = v.entry(d, &k[9..]).expect("entry").expect("listed");
                    links.entry(e.ino).or_default().insert((d, k[9..].to_vec()));
                }
            }
            for (ino, names) in &links {
                let i = v.inode(*ino).expect("inode");
                assert_eq!(i.nlink as usize, names.len(), "step {step}: nlink of {ino}");
                assert!(
                    names.contains(&(i.parent, i.name.clone())),
                    "step {step}: {ino} records {:?}, links {names:?}",
                    (i.parent, &i.name)
                );
                let kept: BTreeSet<(u64, Vec<u8>)> = v
                    .keys_with_prefix(&keys::link_prefix(*ino))
                    .expect("scan")
                    .iter()
                    .map(|k| (keys::trailing_u64(k), k[17..].to_vec()))
                    .collect();
                let want = if names.len() > 1 { names.clone() } else { BTreeSet::new() };
                assert_eq!(kept, want, "step {step}: names kept for {ino}");
            }
        }
    }
}

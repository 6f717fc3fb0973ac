//! Request tags: which client requests a volume's state includes.
//!
//! A branch owner applies operations that clients on other nodes send. A
//! client whose reply was lost (a broken connection, an owner that
//! crashed) must be able to ask "did my request happen?" and get the truth
//! even from the next owner, or a retried `unlink`, `rename` or
//! `O_EXCL` create is applied twice. So a tagged operation's intent
//! carries its tag (client, slot, sequence) after the operation's bytes,
//! and applying it also records the tag in the tree under
//! `Q client slot` in the same transaction: the tag is durable exactly
//! when the operation is, and recovery rebuilds it by replaying the
//! intent. A slot carries one request at a time (or, for a write lane,
//! requests applied in the order they were sent), so the newest sequence
//! of a slot says which of its requests the state includes.
//!
//! The tag reaches `Volume::run` through a thread-local set by
//! [`Volume::tagged`] for the span of one call: the `Volume` operations
//! keep their signatures, and only the first intent of the call that is
//! the operation itself (not a piece of a large write, not the spill of an
//! inline file, not the drop of an orphan) takes it. A client's write may
//! first drop the file's set-id bits or capabilities (their own intents):
//! its tag waits for the write's own intent, so a tag is never durable
//! before the bytes it stands for. A call that succeeds without logging
//! anything logs [`Op::Mark`] with its tag, so every tag a client was
//! answered for can be found after a crash.

use super::keys;
use super::ops::Op;
use super::txn::Txn;
use super::Volume;
use crate::error::{Error, Result};
use crate::format::{decode_value, encode_value};
use std::cell::Cell;

/// One client request: which client (a random id a client mount picks at
/// start), which of its slots, and the slot's sequence number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, bincode::Encode, bincode::Decode)]
pub struct RequestTag {
    pub client: u64,
    pub slot: u32,
    pub seq: u64,
}

/// The client id whose slot 0 records how far a branch's owner reserved
/// inode numbers (every writer starts past it, see `open::replay`).
pub const INODES_RESERVED_CLIENT: u64 = u64::MAX - 1;

/// Which intent of a tagged call takes the tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Takes {
    /// The first that is the operation itself.
    Operation,
    /// Only a write's own intent (a client's write).
    Write,
}

thread_local! {
    static CURRENT: Cell<Option<(RequestTag, Takes)>> = const { Cell::new(None) };
}

/// Whether `op` is the operation a caller asked for rather than a step
/// of one (those never carry the tag).
fn takes_tag(op: &Op) -> bool {
    !matches!(
        op,
        Op::WritePart { .. } | Op::Spill { .. } | Op::DropOrphan { .. } | Op::Relocate { .. } | Op::InitRoot { .. }
    )
}

/// The tag for an intent of `op` about to be logged on this thread, if a
/// tagged call is under way and has not used its tag yet.
pub(super) fn take_for(op: &Op) -> Option<RequestTag> {
    if !takes_tag(op) {
        return None;
    }
    CURRENT.with(|c| match c.get() {
        Some((_, Takes::Write)) if !matches!(op, Op::Write { .. } | Op::CloneRange { .. }) => None,
        Some((tag, _)) => {
            c.set(None);
            Some(tag)
        }
        None => None,
    })
}

/// An intent's bytes: the operation, then its tag if it has one.
pub(super) fn encode_intent(op: &Op, tag: Option<&RequestTag>) -> Vec<u8> {
    let mut meta = encode_value(op);
    if let Some(tag) = tag {
        meta.extend_from_slice(&encode_value(tag));
    }
    meta
}

/// Splits an intent's bytes into its operation and tag.
pub(super) fn decode_intent(meta: &[u8]) -> Result<(Op, Option<RequestTag>)> {
    let cfg = bincode::config::standard().with_limit::<{ crate::format::DECODE_LIMIT }>();
    let bad = || Error::Corrupted { what: "intent", addr: "value".into() };
    let (op, used): (Op, usize) = bincode::decode_from_slice(meta, cfg).map_err(|_| bad())?;
    match meta.get(used..) {
        Some([]) | None => Ok((op, None)),
        Some(rest) => Ok((op, Some(decode_value(rest, "request tag")?))),
    }
}

/// Records `tag` in the tree: part of the transaction that applies its
/// operation.
pub(super) fn record(tx: &mut Txn, tag: &RequestTag, features: &mut u64) -> Result<()> {
    let key = keys::request(tag.client, tag.slot);
    // The newest sequence stays: a request applied late (after a later one
    // of its slot) does not lower it.
    let had =
        tx.tree.get(tx.store, &key)?.and_then(|v| v.get(..8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes));
    if had.is_some_and(|h| h >= tag.seq) {
        return Ok(());
    }
    tx.put(key, tag.seq.to_le_bytes().to_vec())?;
    *features |= super::commit::features::REQUEST_SLOTS;
    Ok(())
}

/// Clears the tag when a tagged call ends, whether or not it logged.
struct Reset;

impl Drop for Reset {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(None));
    }
}

impl Volume {
    /// Runs `f` (one call of this volume's operations) as request `tag`:
    /// its intent carries the tag, and the tree records it with the
    /// operation. A call that fails before logging records nothing; one
    /// that succeeds without logging (a rename onto itself, an empty
    /// write) logs [`Op::Mark`] with the tag.
    pub fn tagged<T>(&self, tag: RequestTag, takes: Takes, f: impl FnOnce(&Volume) -> Result<T>) -> Result<T> {
        CURRENT.with(|c| c.set(Some((tag, takes))));
        let _reset = Reset;
        let out = f(self)?;
        if CURRENT.with(|c| c.get().is_some()) {
            CURRENT.with(|c| c.set(Some((tag, Takes::Operation))));
            let mut st = self.state.write();
            self.run(&mut st, Op::Mark, &[])?;
        }
        Ok(out)
    }

    /// The newest sequence of each slot of `client` this volume's state
    /// includes: `(slot, seq)` in slot order.
    pub fn request_slots(&self, client: u64) -> Result<Vec<(u32, u64)>> {
        let st = self.state.read();
        let v = self.view(&st);
        let prefix = keys::request_prefix(client);
        let mut out = Vec::new();
        v.tree.scan(v.store, &prefix, &mut |k, val| {
            if !k.starts_with(&prefix) {
                return Ok(false);
            }
            let slot = k.get(9..13).and_then(|b| b.try_into().ok()).map(u32::from_be_bytes);
            let seq = val.get(..8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes);
            if let (Some(slot), Some(seq)) = (slot, seq) {
                out.push((slot, seq));
            }
            Ok(true)
        })?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::SimDevice;
    use crate::env::TestEnv;
    use crate::volume::{Config, ROOT_INO};
    use std::sync::Arc;

    fn cfg() -> Config {
        Config { commit_interval: None, env: TestEnv::new(3), ..Config::default() }
    }

    fn tag(slot: u32, seq: u64) -> RequestTag {
        RequestTag { client: 0xc1, slot, seq }
    }

    #[test]
    fn an_intent_without_a_tag_reads_as_before() {
        let op = Op::DropOrphan { ino: 9 };
        let (back, t) = decode_intent(&encode_intent(&op, None)).expect("decode");
        assert!(matches!(back, Op::DropOrphan { ino: 9 }));
        assert_eq!(t, None);
        let (_, t) = decode_intent(&encode_intent(&op, Some(&tag(2, 7)))).expect("decode");
        assert_eq!(t, Some(tag(2, 7)));
        let mut bad = encode_intent(&op, Some(&tag(2, 7)));
        bad.push(0xff);
        assert!(decode_intent(&bad).is_err(), "trailing bytes after a tag are corrupt");
    }

    #[test]
    fn a_tagged_operation_is_recorded_with_it_and_survives_recovery() {
        let dev: Arc<dyn crate::device::Device> = Arc::new(SimDevice::new());
        let vol = Volume::open(dev.clone(), cfg()).expect("open");
        vol.tagged(tag(0, 1), Takes::Operation, |v| v.create(ROOT_INO, b"a", libc::S_IFREG | 0o644, 0, 0, 0))
            .expect("create");
        // A refused operation records nothing.
        let dup = vol.tagged(tag(0, 2), Takes::Operation, |v| v.mkdir(ROOT_INO, b"a", 0o755, 0, 0));
        assert!(dup.is_err());
        let a = vol.lookup(ROOT_INO, b"a").expect("a");
        vol.tagged(tag(1, 5), Takes::Write, |v| v.write(a.ino, 0, &vec![7u8; 3 << 20])).expect("write");
        vol.tagged(tag(1, 6), Takes::Operation, |v| {
            v.rename(ROOT_INO, b"a", ROOT_INO, b"b", crate::volume::RenameMode::Plain)
        })
        .expect("rename");
        // A call that logs nothing of its own logs its tag.
        vol.tagged(tag(1, 7), Takes::Write, |v| v.write(a.ino, 0, &[])).expect("empty write");
        // Untagged calls change nothing of the slots.
        vol.mkdir(ROOT_INO, b"d", 0o755, 0, 0).expect("mkdir");
        assert_eq!(vol.request_slots(0xc1).expect("slots"), vec![(0, 1), (1, 7)]);
        assert_eq!(vol.request_slots(0xc2).expect("slots"), vec![]);
        vol.sync_all().expect("sync");
        drop(vol);
        // Recovery replays the intents (no commit was written since open).
        let again = Volume::open(dev, cfg()).expect("reopen");
        assert_eq!(again.request_slots(0xc1).expect("slots"), vec![(0, 1), (1, 7)]);
        assert_eq!(again.read(again.lookup(ROOT_INO, b"b").expect("b").ino, 0, 8).expect("read"), vec![7u8; 8]);
    }

    #[test]
    fn the_tag_goes_to_the_operation_not_to_the_pieces_of_a_write() {
        let dev: Arc<dyn crate::device::Device> = Arc::new(SimDevice::new());
        let vol = Volume::open(dev.clone(), Config { segment_size: 1 << 20, ..cfg() }).expect("open");
        let a = vol.create(ROOT_INO, b"big", libc::S_IFREG | 0o644, 0, 0, 0).expect("create");
        vol.write(a.ino, 0, b"inline").expect("small write stays inline");
        // A write of several records, spilling the inline bytes first.
        vol.tagged(tag(3, 9), Takes::Write, |v| {
            // A client's write may drop the file's privileges first: the
            // tag waits for the write itself.
            v.setattr(a.ino, crate::volume::SetAttr { perm: Some(0o600), ..Default::default() })?;
            v.write(a.ino, 0, &vec![1u8; 5 << 20])
        })
        .expect("write");
        // The privileges went, the write was refused: the tag was not used.
        let d = vol.mkdir(ROOT_INO, b"dir", 0o755, 0, 0).expect("mkdir");
        let refused = vol.tagged(tag(3, 10), Takes::Write, |v| {
            v.setattr(a.ino, crate::volume::SetAttr { perm: Some(0o644), ..Default::default() })?;
            v.write(d.ino, 0, b"x")
        });
        assert!(refused.is_err());
        vol.sync_all().expect("sync");
        drop(vol);
        let again = Volume::open(dev, cfg()).expect("reopen");
        assert_eq!(again.request_slots(0xc1).expect("slots"), vec![(3, 9)]);
        assert_eq!(again.getattr(a.ino).expect("attr").perm, 0o644);
        assert_eq!(again.getattr(a.ino).expect("attr").size, 5 << 20);
    }
}

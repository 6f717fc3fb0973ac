//! What a branch's owner lets its clients do to who owns a file and to
//! what running a file grants. A client's kernel has checked its caller
//! already, but the owner applies whatever a holder of the token sends,
//! and root on one node is not to be root on every node. So the owner,
//! by these rules:
//!
//! - **refuses privileges** with EPERM: a set-user-ID bit, a set-group-ID
//!   bit on a group-executable file that is not a directory, file
//!   capabilities (`security.capability`), character and block devices —
//!   unless it was started with `--allow-suid-devices` ([`Policy::allow_suid_devices`]).
//!   A set-group-ID directory grants nothing (it hands its group down),
//!   and FIFOs and sockets are plain files: those are allowed. Bits a file
//!   already has are not refused again (a `chmod` that keeps them);
//! - **squashes root** ([`Policy::root_squash`], on unless `--no-root-squash`):
//!   a caller uid 0 is taken as [`NOBODY`] and a gid 0 as [`NOBODY`], for
//!   the owner of what it creates and for the checks below, and no
//!   caller's write keeps set-ID bits (only root may);
//! - **checks changes of owner and mode** as a local kernel does, knowing
//!   only the caller's uid and primary gid (a FUSE request carries no
//!   other groups): root may change anything; another user may not change
//!   a file's user (save to the one it has, on a file it owns), may change
//!   its group only on a file it owns and only to the file's group or its
//!   own primary group (not to its other groups, which a local kernel
//!   would allow), and may change the mode only of a file it owns; a
//!   set-group-ID bit set by a user outside the file's group is dropped,
//!   as Linux drops it. A truncation by anyone but root clears set-ID
//!   bits, as any write by them does. Times and sizes are not checked
//!   here: the client's kernel checked them.
//!
//! These rules decide; [`crate::branch::owner`] applies. What they cannot do: the
//! caller's uid and gid are what the client says, so the token is what
//! keeps strangers out, and a token holder can act as any user but root
//! (with root squash) — never make a file that grants privileges.

pub use arbor_engine::files::Caller;
use arbor_engine::volume::{Attr, FileKind, SetAttr};

/// The uid and gid root is squashed to (`nobody`, `nogroup`).
pub const NOBODY: u32 = 65534;

/// The extended attribute that gives a file capabilities when run.
pub const CAPABILITIES: &[u8] = arbor_engine::files::CAPABILITIES;

/// An errno the owner answers instead of applying.
pub type Refused = i32;

/// How an owner treats its clients' callers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    /// Accept set-ID bits, capabilities and device nodes from clients:
    /// root on any node that can write the branch is then root on every
    /// node that mounts it with `--allow-suid-devices`.
    pub allow_suid_devices: bool,
    /// Treat a caller's uid 0 and gid 0 as [`NOBODY`].
    pub root_squash: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Policy { allow_suid_devices: false, root_squash: true }
    }
}

/// A SETATTR as asked and as permitted: what the owner passes to
/// `Files::setattr_by`.
#[derive(Clone, Debug)]
pub struct Change {
    pub change: SetAttr,
    pub caller: Caller,
    /// Clear the file's set-ID bits and capabilities with the change.
    pub kill_suidgid: bool,
}

const SUID: u16 = libc::S_ISUID as u16;
const SGID: u16 = libc::S_ISGID as u16;
const XGRP: u16 = libc::S_IXGRP as u16;

/// The privileges mode `perm` gives a file of kind `kind`: its set-user-ID
/// bit, and its set-group-ID bit where that is one (a group-executable
/// file, not a directory).
fn privileges(kind: FileKind, perm: u16) -> u16 {
    let sgid = kind != FileKind::Directory && perm & (SGID | XGRP) == SGID | XGRP;
    (perm & SUID) | if sgid { SGID } else { 0 }
}

fn squash(id: u32) -> u32 {
    if id == 0 {
        NOBODY
    } else {
        id
    }
}

impl Policy {
    /// `caller` as the owner treats it.
    pub fn caller(&self, caller: Caller) -> Caller {
        if !self.root_squash {
            return caller;
        }
        Caller { uid: squash(caller.uid), gid: squash(caller.gid) }
    }

    /// A new file of `mode` (type and permission bits) made by `creator`:
    /// who owns it, or EPERM for a device or set-ID bits the policy
    /// refuses. An unknown type is the volume's to refuse.
    pub fn create(&self, mode: u32, creator: Caller) -> Result<Caller, Refused> {
        if !self.allow_suid_devices {
            if let Some(kind) = FileKind::from_mode(mode) {
                let device = matches!(kind, FileKind::CharDevice | FileKind::BlockDevice);
                if device || privileges(kind, (mode & 0o7777) as u16) != 0 {
                    return Err(libc::EPERM);
                }
            }
        }
        Ok(self.caller(creator))
    }

    /// What `asked` of file `file` amounts to: the change, perhaps with
    /// its set-group-ID bit dropped, the caller squashed, and whether the
    /// file's set-ID bits go; EPERM if `asked.caller` may not make it.
    pub fn setattr(&self, file: &Attr, asked: Change) -> Result<Change, Refused> {
        let caller = self.caller(asked.caller);
        let mut change = asked.change;
        let root = caller.is_root();
        let owns = caller.uid == file.uid;
        let may_set_uid = |uid: u32| root || (owns && uid == file.uid);
        let may_set_gid = |gid: u32| root || (owns && (gid == file.gid || gid == caller.gid));
        if !change.uid.is_none_or(may_set_uid) || !change.gid.is_none_or(may_set_gid) {
            return Err(libc::EPERM);
        }
        if let Some(perm) = change.perm.as_mut() {
            if !(root || owns) {
                return Err(libc::EPERM);
            }
            if !root && caller.gid != change.gid.unwrap_or(file.gid) {
                *perm &= !SGID;
            }
            let added = privileges(file.kind, *perm) & !privileges(file.kind, file.perm);
            if added != 0 && !self.allow_suid_devices {
                return Err(libc::EPERM);
            }
        }
        let kill_suidgid = asked.kill_suidgid || (change.size.is_some() && !root);
        Ok(Change { change, caller, kill_suidgid })
    }

    /// Whether extended attribute `name` may be set.
    pub fn setxattr(&self, name: &[u8]) -> Result<(), Refused> {
        if name == CAPABILITIES && !self.allow_suid_devices {
            return Err(libc::EPERM);
        }
        Ok(())
    }

    /// Whether a write clears set-ID bits: `unprivileged` (the client's
    /// kernel says its caller lacks CAP_FSETID), or any write under root
    /// squash, where no caller is root.
    pub fn write_clears_set_id(&self, unprivileged: bool) -> bool {
        unprivileged || self.root_squash
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arbor_engine::env::Timestamp;

    const STRICT: Policy = Policy { allow_suid_devices: false, root_squash: true };
    const TRUSTING: Policy = Policy { allow_suid_devices: true, root_squash: false };
    const ROOT: Caller = Caller::ROOT;
    const ALICE: Caller = Caller { uid: 1000, gid: 1000 };
    const BOB: Caller = Caller { uid: 1001, gid: 1001 };

    fn file(kind: FileKind, perm: u16, uid: u32, gid: u32) -> Attr {
        let t = Timestamp::default();
        Attr {
            ino: 7,
            kind,
            perm,
            nlink: 1,
            uid,
            gid,
            size: 0,
            blocks: 0,
            atime: t,
            mtime: t,
            ctime: t,
            crtime: t,
            rdev: 0,
            blksize: 4096,
        }
    }

    fn ask(change: SetAttr, caller: Caller) -> Change {
        Change { change, caller, kill_suidgid: false }
    }

    fn chmod(perm: u16) -> SetAttr {
        SetAttr { perm: Some(perm), ..Default::default() }
    }

    fn chown(uid: Option<u32>, gid: Option<u32>) -> SetAttr {
        SetAttr { uid, gid, ..Default::default() }
    }

    #[test]
    fn root_is_squashed_to_nobody_unless_told_not_to() {
        assert_eq!(STRICT.caller(ROOT), Caller { uid: NOBODY, gid: NOBODY });
        assert_eq!(STRICT.caller(Caller { uid: 1000, gid: 0 }), Caller { uid: 1000, gid: NOBODY });
        assert_eq!(STRICT.caller(ALICE), ALICE);
        assert_eq!(TRUSTING.caller(ROOT), ROOT);
        // What root makes belongs to nobody.
        assert_eq!(STRICT.create(libc::S_IFREG | 0o644, ROOT), Ok(Caller { uid: NOBODY, gid: NOBODY }));
        assert_eq!(TRUSTING.create(libc::S_IFREG | 0o644, ROOT), Ok(ROOT));
    }

    #[test]
    fn devices_and_set_id_files_are_refused_unless_allowed() {
        let refused = [
            libc::S_IFCHR | 0o666,
            libc::S_IFBLK | 0o600,
            libc::S_IFREG | 0o4755,
            libc::S_IFREG | 0o4644,
            libc::S_IFREG | 0o2755,
            libc::S_IFDIR | 0o4755,
        ];
        for mode in refused {
            assert_eq!(STRICT.create(mode, ALICE), Err(libc::EPERM), "{mode:o}");
            assert_eq!(Policy { root_squash: false, ..STRICT }.create(mode, ROOT), Err(libc::EPERM), "{mode:o}");
            assert_eq!(TRUSTING.create(mode, ALICE), Ok(ALICE), "{mode:o}");
        }
        // FIFOs, sockets, set-group-ID folders and set-group-ID without
        // group execute (a locking mark) grant nothing.
        for mode in [libc::S_IFIFO | 0o644, libc::S_IFSOCK | 0o755, libc::S_IFDIR | 0o2775, libc::S_IFREG | 0o2644] {
            assert_eq!(STRICT.create(mode, ALICE), Ok(ALICE), "{mode:o}");
        }
        assert_eq!(STRICT.setxattr(CAPABILITIES), Err(libc::EPERM));
        assert_eq!(STRICT.setxattr(b"user.note"), Ok(()));
        assert_eq!(STRICT.setxattr(b"security.selinux"), Ok(()));
        assert_eq!(TRUSTING.setxattr(CAPABILITIES), Ok(()));
    }

    #[test]
    fn set_id_bits_are_refused_when_added_not_when_kept() {
        let plain = file(FileKind::Regular, 0o755, 1000, 1000);
        let no_root_squash = Policy { root_squash: false, ..STRICT };
        for (policy, who) in [(STRICT, ALICE), (no_root_squash, ROOT)] {
            assert_eq!(policy.setattr(&plain, ask(chmod(0o4755), who)).err(), Some(libc::EPERM));
            assert_eq!(policy.setattr(&plain, ask(chmod(0o2755), who)).err(), Some(libc::EPERM));
        }
        let granted = TRUSTING.setattr(&plain, ask(chmod(0o4755), ALICE)).expect("allowed");
        assert_eq!(granted.change.perm, Some(0o4755));
        // A file that has the bit keeps it through a chmod.
        let tool = file(FileKind::Regular, 0o4755, 1000, 1000);
        assert!(STRICT.setattr(&tool, ask(chmod(0o4750), ALICE)).is_ok());
        // Group execute makes an old set-group-ID bit a privilege: added.
        let marked = file(FileKind::Regular, 0o2644, 1000, 1000);
        assert_eq!(STRICT.setattr(&marked, ask(chmod(0o2754), ALICE)).err(), Some(libc::EPERM));
        // A folder's set-group-ID bit hands its group down: allowed.
        let dir = file(FileKind::Directory, 0o755, 1000, 1000);
        assert_eq!(STRICT.setattr(&dir, ask(chmod(0o2775), ALICE)).expect("allowed").change.perm, Some(0o2775));
    }

    #[test]
    fn only_root_gives_files_away_and_owners_change_group_to_their_own() {
        let f = file(FileKind::Regular, 0o644, 1000, 1000);
        let no_root_squash = Policy { root_squash: false, ..STRICT };
        assert!(no_root_squash.setattr(&f, ask(chown(Some(1001), Some(50)), ROOT)).is_ok());
        // Squashed root is nobody, who owns nothing here.
        assert_eq!(STRICT.setattr(&f, ask(chown(Some(1001), None), ROOT)).err(), Some(libc::EPERM));
        assert_eq!(STRICT.setattr(&f, ask(chown(None, Some(NOBODY)), ROOT)).err(), Some(libc::EPERM));
        // Not even the owner gives a file away; to itself it may.
        assert_eq!(STRICT.setattr(&f, ask(chown(Some(1001), None), ALICE)).err(), Some(libc::EPERM));
        assert!(STRICT.setattr(&f, ask(chown(Some(1000), None), ALICE)).is_ok());
        assert_eq!(STRICT.setattr(&f, ask(chown(Some(1000), None), BOB)).err(), Some(libc::EPERM));
        // Group: the owner, to its own primary group or the file's.
        let shared = file(FileKind::Regular, 0o644, 1000, 50);
        assert!(STRICT.setattr(&shared, ask(chown(None, Some(1000)), ALICE)).is_ok());
        assert!(STRICT.setattr(&shared, ask(chown(None, Some(50)), ALICE)).is_ok());
        assert_eq!(STRICT.setattr(&shared, ask(chown(None, Some(60)), ALICE)).err(), Some(libc::EPERM));
        assert_eq!(STRICT.setattr(&shared, ask(chown(None, Some(1001)), BOB)).err(), Some(libc::EPERM));
    }

    #[test]
    fn only_the_owner_or_root_changes_the_mode() {
        let f = file(FileKind::Regular, 0o644, 1000, 1000);
        assert!(STRICT.setattr(&f, ask(chmod(0o600), ALICE)).is_ok());
        assert_eq!(STRICT.setattr(&f, ask(chmod(0o600), BOB)).err(), Some(libc::EPERM));
        assert_eq!(STRICT.setattr(&f, ask(chmod(0o600), ROOT)).err(), Some(libc::EPERM), "squashed");
        assert!(Policy { root_squash: false, ..STRICT }.setattr(&f, ask(chmod(0o600), ROOT)).is_ok());
        // What root makes under squash, root may change.
        let made = file(FileKind::Regular, 0o644, NOBODY, NOBODY);
        assert!(STRICT.setattr(&made, ask(chmod(0o600), ROOT)).is_ok());
        // Times and sizes are the client kernel's to check.
        let touch = SetAttr { size: Some(0), ..Default::default() };
        assert!(STRICT.setattr(&f, ask(touch, BOB)).is_ok());
    }

    #[test]
    fn a_set_group_id_bit_from_outside_the_group_is_dropped_as_linux_does() {
        let dir = file(FileKind::Directory, 0o755, 1000, 50);
        let asked = ask(chmod(0o2775), ALICE);
        assert_eq!(STRICT.setattr(&dir, asked).expect("allowed").change.perm, Some(0o0775));
        // In the group (after a change to its own group in the same call): kept.
        let asked = ask(SetAttr { perm: Some(0o2775), gid: Some(1000), ..Default::default() }, ALICE);
        assert_eq!(STRICT.setattr(&dir, asked).expect("allowed").change.perm, Some(0o2775));
        // Root keeps it anywhere, and outside the group a would-be
        // privilege is dropped, not refused.
        let root = Policy { root_squash: false, ..TRUSTING };
        assert_eq!(root.setattr(&dir, ask(chmod(0o2775), ROOT)).expect("root").change.perm, Some(0o2775));
        let f = file(FileKind::Regular, 0o755, 1000, 50);
        assert_eq!(STRICT.setattr(&f, ask(chmod(0o2755), ALICE)).expect("dropped").change.perm, Some(0o0755));
    }

    #[test]
    fn truncations_and_writes_by_anyone_but_root_clear_set_id_bits() {
        let f = file(FileKind::Regular, 0o4755, 1000, 1000);
        let truncate = || SetAttr { size: Some(0), ..Default::default() };
        let no_root_squash = Policy { root_squash: false, ..TRUSTING };
        assert!(STRICT.setattr(&f, ask(truncate(), ALICE)).expect("ok").kill_suidgid);
        assert!(STRICT.setattr(&f, ask(truncate(), ROOT)).expect("ok").kill_suidgid, "squashed root");
        assert!(!no_root_squash.setattr(&f, ask(truncate(), ROOT)).expect("ok").kill_suidgid);
        let asked = Change { kill_suidgid: true, ..ask(truncate(), ROOT) };
        assert!(no_root_squash.setattr(&f, asked).expect("ok").kill_suidgid, "the kernel's word stands");
        assert!(STRICT.write_clears_set_id(false));
        assert!(!no_root_squash.write_clears_set_id(false));
        assert!(no_root_squash.write_clears_set_id(true));
    }
}

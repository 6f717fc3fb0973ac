//! Tree keys: a tag byte, then big-endian numbers so memcmp order is numeric
//! order, then names.

pub const INODE: u8 = b'I';
pub const DIRENT: u8 = b'D';
pub const COOKIE: u8 = b'R';
pub const EXTENT: u8 = b'E';
pub const XATTR: u8 = b'X';
pub const ORPHAN: u8 = b'O';
pub const LINK: u8 = b'L';
pub const SOURCE: u8 = b'S';
/// The newest request of a client's slot the tree includes ([`super::requests`]).
pub const REQUEST: u8 = b'Q';

fn tagged(tag: u8, a: u64, rest: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(9 + rest.len());
    k.push(tag);
    k.extend_from_slice(&a.to_be_bytes());
    k.extend_from_slice(rest);
    k
}

pub fn inode(ino: u64) -> Vec<u8> {
    tagged(INODE, ino, &[])
}

pub fn dirent(parent: u64, name: &[u8]) -> Vec<u8> {
    tagged(DIRENT, parent, name)
}

/// All directory entries of `parent` start with this.
pub fn dirent_prefix(parent: u64) -> Vec<u8> {
    tagged(DIRENT, parent, &[])
}

/// Directory listing order: by a per-directory counter, so a readdir offset
/// stays valid however the directory changes.
pub fn cookie(parent: u64, cookie: u64) -> Vec<u8> {
    tagged(COOKIE, parent, &cookie.to_be_bytes())
}

pub fn cookie_prefix(parent: u64) -> Vec<u8> {
    tagged(COOKIE, parent, &[])
}

/// Extents are keyed by their end offset, so the first key past an offset
/// names the extent that covers it.
pub fn extent(ino: u64, end: u64) -> Vec<u8> {
    tagged(EXTENT, ino, &end.to_be_bytes())
}

pub fn extent_prefix(ino: u64) -> Vec<u8> {
    tagged(EXTENT, ino, &[])
}

pub fn xattr(ino: u64, name: &[u8]) -> Vec<u8> {
    tagged(XATTR, ino, name)
}

pub fn xattr_prefix(ino: u64) -> Vec<u8> {
    tagged(XATTR, ino, &[])
}

pub fn orphan(ino: u64) -> Vec<u8> {
    tagged(ORPHAN, ino, &[])
}

/// One name of a file that has several: `ino`, then the directory and the
/// name. Kept while a file has two links or more, so that removing the
/// link an inode records as its name can record another.
pub fn link(ino: u64, parent: u64, name: &[u8]) -> Vec<u8> {
    let mut k = tagged(LINK, ino, &parent.to_be_bytes());
    k.extend_from_slice(name);
    k
}

pub fn link_prefix(ino: u64) -> Vec<u8> {
    tagged(LINK, ino, &[])
}

/// The object an imported file reads from.
pub fn source(ino: u64) -> Vec<u8> {
    tagged(SOURCE, ino, &[])
}

pub fn request(client: u64, slot: u32) -> Vec<u8> {
    tagged(REQUEST, client, &slot.to_be_bytes())
}

/// Every slot of `client` starts with this.
pub fn request_prefix(client: u64) -> Vec<u8> {
    tagged(REQUEST, client, &[])
}

/// The big-endian u64 at bytes 9..17 of a key (a cookie or an extent end).
pub fn trailing_u64(key: &[u8]) -> u64 {
    key.get(9..17).and_then(|b| b.try_into().ok()).map_or(0, u64::from_be_bytes)
}

/// The u64 right after the tag byte.
pub fn leading_u64(key: &[u8]) -> u64 {
    key.get(1..9).and_then(|b| b.try_into().ok()).map_or(0, u64::from_be_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numeric_order_is_byte_order() {
        assert!(extent(1, 255) < extent(1, 256));
        assert!(extent(1, u64::MAX) < extent(2, 0));
        assert!(dirent(7, b"zzz") < dirent(8, b""));
        assert_eq!(trailing_u64(&cookie(3, 99)), 99);
        assert_eq!(leading_u64(&orphan(42)), 42);
    }
}

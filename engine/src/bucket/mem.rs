//! An in-memory object store: for model tests, beside the real ones.

use super::{check_key, ETag, ObjectStore};
use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::ops::Range;

#[derive(Default)]
pub struct MemObjectStore {
    objects: Mutex<BTreeMap<String, (Vec<u8>, u64)>>,
    next_version: Mutex<u64>,
}

impl MemObjectStore {
    pub fn new() -> Self {
        Self::default()
    }

    fn tag(&self) -> u64 {
        let mut v = self.next_version.lock();
        *v += 1;
        *v
    }
}

impl ObjectStore for MemObjectStore {
    fn put(&self, key: &str, body: &[u8]) -> Result<ETag> {
        check_key(key)?;
        let v = self.tag();
        self.objects.lock().insert(key.into(), (body.to_vec(), v));
        Ok(v.to_string())
    }

    fn put_if_absent(&self, key: &str, body: &[u8]) -> Result<ETag> {
        check_key(key)?;
        let v = self.tag();
        let mut objects = self.objects.lock();
        if objects.contains_key(key) {
            return Err(Error::AlreadyExists(key.into()));
        }
        objects.insert(key.into(), (body.to_vec(), v));
        Ok(v.to_string())
    }

    fn put_if_match(&self, key: &str, body: &[u8], etag: &str) -> Result<ETag> {
        check_key(key)?;
        let v = self.tag();
        let mut objects = self.objects.lock();
        match objects.get(key) {
            None => Err(Error::NoSuchObject(key.into())),
            Some((_, cur)) if cur.to_string() != etag => Err(Error::PreconditionFailed(key.into())),
            Some(_) => {
                objects.insert(key.into(), (body.to_vec(), v));
                Ok(v.to_string())
            }
        }
    }

    fn get(&self, key: &str) -> Result<(Vec<u8>, ETag)> {
        let objects = self.objects.lock();
        let (body, v) = objects.get(key).ok_or_else(|| Error::NoSuchObject(key.into()))?;
        Ok((body.clone(), v.to_string()))
    }

    fn get_range(&self, key: &str, range: Range<u64>) -> Result<Vec<u8>> {
        let (body, _) = self.get(key)?;
        let len = body.len() as u64;
        if range.start > range.end || range.start >= len && !(range.start == 0 && len == 0) {
            return Err(Error::Invalid("range outside the object"));
        }
        Ok(body[range.start as usize..range.end.min(len) as usize].to_vec())
    }

    fn list(&self, prefix: &str) -> Result<Vec<String>> {
        Ok(self.objects.lock().keys().filter(|k| k.starts_with(prefix)).cloned().collect())
    }

    fn size(&self, key: &str) -> Result<u64> {
        let objects = self.objects.lock();
        objects.get(key).map(|(b, _)| b.len() as u64).ok_or_else(|| Error::NoSuchObject(key.into()))
    }

    fn delete(&self, key: &str) -> Result<()> {
        check_key(key)?;
        self.objects.lock().remove(key);
        Ok(())
    }
}

/// What a [`Watched`] store runs before each ranged GET.
#[cfg(test)]
pub(crate) trait BeforeGet: Send + Sync {
    /// Runs before a ranged GET (`conditional`: a [`ObjectStore::get_range_if`])
    /// of `range` of `key`; it may record, hold up or panic.
    fn before_get(&self, key: &str, range: &Range<u64>, conditional: bool);
}

/// An in-memory store whose ranged GETs run `watch` first, every call then
/// going to the store: for tests that count, order or hold up reads. The
/// watch's own fields read through it (`Deref`).
#[cfg(test)]
#[derive(Default)]
pub(crate) struct Watched<W> {
    pub(crate) inner: MemObjectStore,
    pub(crate) watch: W,
}

#[cfg(test)]
impl<W> std::ops::Deref for Watched<W> {
    type Target = W;
    fn deref(&self) -> &W {
        &self.watch
    }
}

#[cfg(test)]
impl<W: BeforeGet> ObjectStore for Watched<W> {
    fn put(&self, key: &str, body: &[u8]) -> Result<ETag> {
        self.inner.put(key, body)
    }
    fn put_if_absent(&self, key: &str, body: &[u8]) -> Result<ETag> {
        self.inner.put_if_absent(key, body)
    }
    fn put_if_match(&self, key: &str, body: &[u8], etag: &str) -> Result<ETag> {
        self.inner.put_if_match(key, body, etag)
    }
    fn get(&self, key: &str) -> Result<(Vec<u8>, ETag)> {
        self.inner.get(key)
    }
    fn get_range(&self, key: &str, range: Range<u64>) -> Result<Vec<u8>> {
        self.watch.before_get(key, &range, false);
        self.inner.get_range(key, range)
    }
    fn get_range_if(&self, key: &str, range: Range<u64>, etag: &str, version: Option<&str>) -> Result<Vec<u8>> {
        self.watch.before_get(key, &range, true);
        self.inner.get_range_if(key, range, etag, version)
    }
    fn list(&self, prefix: &str) -> Result<Vec<String>> {
        self.inner.list(prefix)
    }
    fn size(&self, key: &str) -> Result<u64> {
        self.inner.size(key)
    }
    fn delete(&self, key: &str) -> Result<()> {
        self.inner.delete(key)
    }
}

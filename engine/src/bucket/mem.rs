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

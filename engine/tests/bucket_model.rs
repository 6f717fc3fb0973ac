//! A model test of the bucket tier: random writes and fsyncs on a volume
//! over a [`BucketDevice`], then the node dies (no close). With bucket
//! durability its whole cache is lost too; with local durability the cache
//! survives. Either way the reopened volume must hold the state after some
//! prefix of the operations that includes every operation before the last
//! fsync — and after a clean close, exactly the final state from the bucket
//! alone.

use arbor_engine::bucket::{MemObjectStore, ObjectStore};
use arbor_engine::env::TestEnv;
use arbor_engine::head::HeadDevice;
use arbor_engine::tier::{BucketDevice, Durability, TierConfig};
use arbor_engine::volume::{Config, Volume, ROOT_INO};
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

#[derive(Clone, Debug)]
enum Op {
    Write { file: u8, off: u32, len: u32, seed: u8 },
    Truncate { file: u8, len: u32 },
    Fsync,
    Commit,
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..4, 0u32..200_000, 1u32..70_000, any::<u8>())
            .prop_map(|(file, off, len, seed)| Op::Write { file, off, len, seed }),
        1 => (0u8..4, 0u32..100_000).prop_map(|(file, len)| Op::Truncate { file, len }),
        3 => Just(Op::Fsync),
        1 => Just(Op::Commit),
    ]
}

type Model = BTreeMap<u8, Vec<u8>>;

fn bytes(len: u32, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed)).collect()
}

fn apply(model: &mut Model, op: &Op) {
    match op {
        Op::Write { file, off, len, seed } => {
            let f = model.entry(*file).or_default();
            let end = (*off + *len) as usize;
            if f.len() < end {
                f.resize(end, 0);
            }
            f[*off as usize..end].copy_from_slice(&bytes(*len, *seed));
        }
        Op::Truncate { file, len } => {
            if let Some(f) = model.get_mut(file) {
                f.resize(*len as usize, 0);
            }
        }
        Op::Fsync | Op::Commit => {}
    }
}

fn cfg() -> Config {
    Config { commit_interval: None, segment_size: 256 << 10, env: TestEnv::new(3), ..Config::default() }
}

fn tier(durability: Durability) -> TierConfig {
    TierConfig {
        durability,
        chunk_size: 32 << 10,
        cache_size: 512 << 10,
        read_ahead: 64 << 10,
        drain_timeout: Some(Duration::from_secs(30)),
        ..TierConfig::default()
    }
}

fn open(store: &Arc<dyn ObjectStore>, cache: &Path, durability: Durability) -> (Arc<Volume>, Arc<BucketDevice>) {
    let dev = BucketDevice::open(store.clone(), cache, tier(durability)).expect("device");
    let vol = Volume::open(HeadDevice::new(dev.clone(), store.clone(), "main"), cfg()).expect("open");
    (vol, dev)
}

fn name(file: u8) -> String {
    format!("f{file}")
}

fn run(vol: &Volume, op: &Op) {
    match op {
        Op::Write { file, off, len, seed } => {
            let ino = match vol.lookup(ROOT_INO, name(*file).as_bytes()) {
                Ok(a) => a.ino,
                Err(_) => {
                    vol.create(ROOT_INO, name(*file).as_bytes(), libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino
                }
            };
            vol.write(ino, *off as u64, &bytes(*len, *seed)).expect("write");
        }
        Op::Truncate { file, len } => {
            if let Ok(a) = vol.lookup(ROOT_INO, name(*file).as_bytes()) {
                let set = arbor_engine::SetAttr { size: Some(*len as u64), ..Default::default() };
                vol.setattr(a.ino, set).expect("truncate");
            }
        }
        Op::Fsync => vol.sync_all().expect("fsync"),
        Op::Commit => vol.commit().expect("commit"),
    }
}

fn state(vol: &Volume) -> Model {
    let mut out = Model::new();
    for file in 0..4u8 {
        if let Ok(a) = vol.lookup(ROOT_INO, name(file).as_bytes()) {
            let mut data = Vec::new();
            while (data.len() as u64) < a.size {
                let part = vol.read(a.ino, data.len() as u64, 1 << 20).expect("read");
                assert!(!part.is_empty(), "short file");
                data.extend_from_slice(&part);
            }
            out.insert(file, data);
        }
    }
    out
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(24)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), max_shrink_iters: 200, ..ProptestConfig::default() })]

    #[test]
    fn a_dead_node_comes_back_as_a_prefix_with_every_fsynced_op(
        ops in proptest::collection::vec(op_strategy(), 1..40),
        bucket in any::<bool>(),
    ) {
        let store: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
        let cache = tempfile::tempdir().expect("cache");
        let durability = if bucket { Durability::Bucket } else { Durability::Local };
        let (vol, dev) = open(&store, &cache.path().join("a"), durability);
        // models[i]: the state after the first i logged operations. A write
        // to a new file logs two (create, then write), so it has two states.
        let mut models = vec![Model::new()];
        let mut durable = 0;
        for op in &ops {
            run(&vol, op);
            let mut m = models.last().expect("model").clone();
            if let Op::Write { file, .. } = op {
                if !m.contains_key(file) {
                    m.insert(*file, Vec::new());
                    models.push(m.clone());
                }
            }
            apply(&mut m, op);
            models.push(m);
            if matches!(op, Op::Fsync | Op::Commit) {
                durable = models.len() - 1;
            }
        }
        drop(vol);
        drop(dev);
        // Bucket durability: the node is gone with its disk. Local: it reboots.
        let again = if bucket {
            std::fs::remove_dir_all(cache.path().join("a")).expect("rm cache");
            cache.path().join("b")
        } else {
            cache.path().join("a")
        };
        let dev = BucketDevice::open(store.clone(), &again, tier(durability)).expect("device");
        let (vol, report) = Volume::open_with_report(HeadDevice::new(dev.clone(), store.clone(), "main"), cfg()).expect("open");
        let got = state(&vol);
        let k = models.iter().rposition(|m| *m == got);
        if k.is_none_or(|k| k < durable) {
            // Would the bucket alone (a fresh cache) have done better?
            let fresh = cache.path().join("diagnosis");
            let dev = BucketDevice::open(store.clone(), &fresh, TierConfig { cache_size: 1 << 30, ..tier(durability) }).expect("device");
            let ro = Config { read_only: true, ..cfg() };
            let (alone, alone_report) = Volume::open_with_report(HeadDevice::new(dev, store.clone(), "main"), ro).expect("open");
            let from_bucket = models.iter().rposition(|m| *m == state(&alone));
            prop_assert!(
                false,
                "recovered state is no prefix >= {} (matches {:?}); recovery {:?}; from the bucket alone: {:?} {:?}",
                durable, k, report, from_bucket, alone_report
            );
        }
        // A clean close, then the bucket alone has exactly that state.
        vol.close().expect("close");
        drop(vol);
        let (vol, _dev) = open(&store, &cache.path().join("c"), Durability::Local);
        prop_assert_eq!(state(&vol), got);
    }
}

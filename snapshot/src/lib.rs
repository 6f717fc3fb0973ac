//! Named roots: checkpoints, branches, diff and GC.
//!
//! Not built yet; see the README's status table. The crate exists so the
//! workspace has its final shape and the dependency direction
//! (`snapshot → engine`) is fixed.

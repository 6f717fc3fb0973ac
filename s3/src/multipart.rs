//! Multipart uploads (not yet).

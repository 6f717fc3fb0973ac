"""Open-but-unlinked files and flock/fcntl locks on the mount at argv[1]."""
import fcntl, os, subprocess, sys
d = sys.argv[1]
p = os.path.join(d, "scratch")
fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
os.unlink(p)
os.write(fd, b"still here")
os.lseek(fd, 0, 0)
assert os.read(fd, 100) == b"still here"
assert not os.path.exists(p)
os.close(fd)
# A file replaced by a rename while open (a checkpoint rotated under a
# reader): the reader keeps reading what it opened, from the server (its
# cached pages dropped first), while the name shows the new file.
old_bytes, new_bytes = os.urandom(3 << 20), os.urandom(1 << 20)
m = os.path.join(d, "model.bin")
with open(m, "wb") as f:
    f.write(old_bytes)
    f.flush()
    os.fsync(f.fileno())
rd = os.open(m, os.O_RDONLY)
os.posix_fadvise(rd, 0, 0, os.POSIX_FADV_DONTNEED)
with open(m + ".tmp", "wb") as f:
    f.write(new_bytes)
os.rename(m + ".tmp", m)
got = b""
while len(got) < len(old_bytes):
    chunk = os.pread(rd, 1 << 20, len(got))
    assert chunk, "the replaced file ended early"
    got += chunk
assert got == old_bytes, "a reader of a file replaced by a rename reads other bytes"
os.close(rd)
with open(m, "rb") as f:
    assert f.read() == new_bytes
lockfile = os.path.join(d, "lock")
f = open(lockfile, "w")
fcntl.flock(f, fcntl.LOCK_EX)
other = subprocess.run([sys.executable, "-c", "import fcntl,sys; f=open(sys.argv[1]); fcntl.flock(f, fcntl.LOCK_EX|fcntl.LOCK_NB)", lockfile])
assert other.returncode != 0, "a second flock must be refused"
fcntl.lockf(f, fcntl.LOCK_EX)
other = subprocess.run([sys.executable, "-c", "import fcntl,sys; f=open(sys.argv[1],'w'); fcntl.lockf(f, fcntl.LOCK_EX|fcntl.LOCK_NB)", lockfile])
assert other.returncode != 0, "a second fcntl lock must be refused"
print("ok")

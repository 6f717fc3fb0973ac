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
lockfile = os.path.join(d, "lock")
f = open(lockfile, "w")
fcntl.flock(f, fcntl.LOCK_EX)
other = subprocess.run([sys.executable, "-c", "import fcntl,sys; f=open(sys.argv[1]); fcntl.flock(f, fcntl.LOCK_EX|fcntl.LOCK_NB)", lockfile])
assert other.returncode != 0, "a second flock must be refused"
fcntl.lockf(f, fcntl.LOCK_EX)
other = subprocess.run([sys.executable, "-c", "import fcntl,sys; f=open(sys.argv[1],'w'); fcntl.lockf(f, fcntl.LOCK_EX|fcntl.LOCK_NB)", lockfile])
assert other.returncode != 0, "a second fcntl lock must be refused"
print("ok")

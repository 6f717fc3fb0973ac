"""Names probed while missing (cached by the kernel as negative entries)
must appear once made through the mount, by every call that makes a name."""
import os, sys
d = sys.argv[1]
def probe(name):
    p = os.path.join(d, name)
    for _ in range(50):
        assert not os.path.lexists(p), name + " exists before it was made"
    return p
open(os.path.join(d, "src"), "w").write("src")
makers = {
    "file": lambda p: open(p, "w").write("x"),
    "dir": lambda p: os.mkdir(p),
    "symlink": lambda p: os.symlink("src", p),
    "hardlink": lambda p: os.link(os.path.join(d, "src"), p),
    "fifo": lambda p: os.mkfifo(p),
    "renamed": lambda p: os.rename(os.path.join(d, "src"), p),
}
for name, make in makers.items():
    p = probe(name)
    make(p)
    assert os.path.lexists(p), name + " missing after it was made"
for name in makers:
    p = os.path.join(d, name)
    os.rmdir(p) if name == "dir" else os.unlink(p)
    assert not os.path.lexists(p), name + " still there after removal"
    os.mkdir(p)
    assert os.path.isdir(p), name + " not made again as a directory"
print("ok")

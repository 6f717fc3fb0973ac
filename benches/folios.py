"""Page-cache folio sizes of a file: reads FILE once (so its pages are
cached), maps it, and asks /proc/self/pagemap and /proc/kpageflags (root)
whether each cached page is a small page or part of a large folio.

  python3 benches/folios.py FILE [FILE...]

Prints one line per file: pages looked at, large-folio heads and tails, and
order-0 (4 KiB) pages. Used to explain warm re-reads: the kernel copies
from large folios faster than from 4 KiB pages.
"""
import ctypes
import os
import struct
import sys

PAGE = 4096
HEAD, TAIL = 1 << 15, 1 << 16  # KPF_COMPOUND_HEAD, KPF_COMPOUND_TAIL


def folios(path, limit=16384):
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        with open(path, "rb") as f:
            while f.read(1 << 20):
                pass
        pages = min(size // PAGE, limit)
        if pages == 0:
            return 0, 0, 0, 0
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        base = libc.mmap(None, pages * PAGE, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        if base in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        mapped = (ctypes.c_char * (pages * PAGE)).from_address(base)
        for i in range(pages):
            mapped[i * PAGE]  # fault each page in
        heads = tails = small = 0
        with open("/proc/self/pagemap", "rb") as pm, open("/proc/kpageflags", "rb") as kf:
            for i in range(pages):
                pm.seek((base // PAGE + i) * 8)
                entry = struct.unpack("Q", pm.read(8))[0]
                if not entry >> 63:
                    continue
                kf.seek((entry & ((1 << 55) - 1)) * 8)
                flags = struct.unpack("Q", kf.read(8))[0]
                if flags & HEAD:
                    heads += 1
                elif flags & TAIL:
                    tails += 1
                else:
                    small += 1
        return pages, heads, tails, small
    finally:
        os.close(fd)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        pages, heads, tails, small = folios(p)
        print(f"{p}: {pages} pages: {heads} large-folio heads, {tails} tails, {small} order-0 pages")

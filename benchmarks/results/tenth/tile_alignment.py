"""Issue 13, tenth part: rdtsc cycles per AMX tile load / 2x2 product step / tile store, with the
buffer on 64-byte lines (offset 0) or 16 / 32 bytes past one. Run: python tile_alignment.py"""
import tempfile
from pathlib import Path

from torch.utils.cpp_extension import load

m = load("tile_alignment", [str(Path(__file__).with_name("tile_alignment.cpp"))], extra_cflags=["-O2"],
         build_directory=tempfile.mkdtemp(), verbose=False)
for mode, name in ((0, "loads only"), (1, "2x2 load+TDP"), (2, "stores only")):
    for off in (0, 16, 32):
        for kb in (8, 256):
            r = min(m.bench(mode, off, 200000, kb) for _ in range(3))
            print(f"{name:14s} offset {off:2d} buf {kb:4d} KB: {r:6.1f} tsc cycles per op")

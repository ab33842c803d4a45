"""Repack the wheels ``stage.sh`` downloaded into fewer copy folders, leaving out the large ones
the GPU check does not need (see docs/gpu-validation.md).

    python benchmarks/gpu/repack_wheels.py .gpu

Reads ``.gpu/all`` (what ``stage.sh`` downloaded), removes ``.gpu/p*`` and writes new folders
``p0``, ``p1``, … of at most 56 MiB each: files larger than that are split into ``NAME.partNN``
(``unstage.sh`` joins them), the rest are packed first-fit, and the last folder gets ``LAST``
and is the smallest. Each folder gets a copy of ``unstage.sh`` (``--unstage``).

Left out by default: flashinfer (its cubin wheel alone is 447 MB; run vLLM with
``VLLM_USE_FLASHINFER_SAMPLER=0``), tokenspeed-triton, the CUTLASS DSL, tilelang, z3-solver and
cuDNN's frontend: kernels a bf16 Qwen2 model on vLLM's FlashAttention backend never loads.
"""

from __future__ import annotations

import argparse
import fnmatch
import shutil
from pathlib import Path

LIMIT = 56 * 2**20
SKIP = (
    "flashinfer_*",
    "tokenspeed_triton-*",
    "nvidia_cutlass_dsl*",
    "tilelang-*",
    "z3_solver-*",
    "nvidia_cudnn_frontend-*",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--skip", nargs="*", default=list(SKIP), help="file-name patterns")
    parser.add_argument(
        "--unstage", type=Path, required=True, help="the install script copied into each folder"
    )
    args = parser.parse_args()

    pieces: list[tuple[str, int, Path, int | None]] = []  # name, size, source, offset
    for path in sorted((args.outdir / "all").iterdir()):
        if any(fnmatch.fnmatch(path.name, pattern) for pattern in args.skip):
            print(f"left out: {path.name}")
            continue
        size = path.stat().st_size
        if size <= LIMIT:
            pieces.append((path.name, size, path, None))
            continue
        for index, offset in enumerate(range(0, size, LIMIT)):
            pieces.append((f"{path.name}.part{index:02d}", min(LIMIT, size - offset), path, offset))

    bins: list[tuple[int, list[tuple[str, int, Path, int | None]]]] = []
    for piece in sorted(pieces, key=lambda piece: -piece[1]):  # first fit, largest first
        for index, (used, members) in enumerate(bins):
            if used + piece[1] <= LIMIT:
                bins[index] = (used + piece[1], [*members, piece])
                break
        else:
            bins.append((piece[1], [piece]))
    bins.sort(key=lambda item: -item[0])

    for old in args.outdir.glob("p[0-9]*"):
        shutil.rmtree(old)
    for index, (used, members) in enumerate(bins):
        folder = args.outdir / f"p{index}"
        folder.mkdir()
        for name, size, source, offset in members:
            if offset is None:
                shutil.copyfile(source, folder / name)
            else:
                with source.open("rb") as reader:
                    reader.seek(offset)
                    (folder / name).write_bytes(reader.read(size))
        shutil.copy(args.unstage, folder / "unstage.sh")
        print(f"{folder}: {used / 2**20:.1f} MiB, {len(members)} files")
    (args.outdir / f"p{len(bins) - 1}" / "LAST").touch()


if __name__ == "__main__":
    main()

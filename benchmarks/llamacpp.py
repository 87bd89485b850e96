"""llama.cpp as a peer in `make bench`: its bf16 and q8_0 rows measured in the same run as Colibri's.

Two ways to point at a llama.cpp build, first found wins:

- your own: `--llamacpp-bin DIR` (or COLIBRI_LLAMACPP_BIN), the folder holding `llama-batched-bench`, with
  `--llamacpp-gguf bf16=PATH,q8_0=PATH` (or COLIBRI_LLAMACPP_GGUF): GGUFs of the same checkpoint;
- the peer script: `--llamacpp-peer PATH` (or COLIBRI_LLAMACPP_PEER; default `../shared/tools/llamacpp-peer`
  beside the project where it exists), which builds llama.cpp once, converts the checkpoint to bf16 and q8_0
  GGUFs and caches both, then runs `llama-batched-bench`.

Either way the numbers are `llama-batched-bench`'s: -npp PROMPT -ntg GEN -npl STREAMS, the same prompt length,
new tokens, streams and threads as Colibri's rows. Two rates per row: decode only (its S_TG) and, to compare
with Colibri's output tok/s (which includes the prefill), streams × GEN ÷ the whole run's time T.

    python -m benchmarks.llamacpp --model .cache/bench-model --streams 1,8,32
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kernels import users_environment

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PEER = ROOT.parent / "shared" / "tools" / "llamacpp-peer"
QUANTS = ("bf16", "q8_0")
_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|" + r"\s*([\d.]+)\s*\|" * 6)


@dataclass(frozen=True)
class Rate:
    """One llama-batched-bench row: B streams, PROMPT + GEN tokens each."""

    streams: int
    decode_tokens_per_s: float        # S_TG: generated tokens ÷ time in the generation phase
    output_tokens_per_s: float        # streams × GEN ÷ T (prefill included), as Colibri's output tok/s


def parse_batched_bench(text: str) -> dict[int, Rate]:
    """The table `llama-batched-bench` prints (| PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s |
    S t/s |) -> its rows by stream count. ValueError when there is no such table (a failed run's output)."""
    rates: dict[int, Rate] = {}
    for line in text.splitlines():
        m = _ROW.match(line.strip())
        if m:
            _pp, tg, b = int(m[1]), int(m[2]), int(m[3])
            s_tg, total = float(m[8]), float(m[9])
            rates[b] = Rate(b, s_tg, b * tg / total if total > 0 else 0.0)
    if not rates:
        raise ValueError("no llama-batched-bench result table in its output:\n" + text[-1500:])
    return rates


@dataclass(frozen=True)
class Peer:
    """Where llama.cpp comes from: a peer script, or a build folder and GGUFs."""

    script: Path | None = None
    bin_dir: Path | None = None
    ggufs: dict[str, Path] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.script is None) == (self.bin_dir is None):
            raise ValueError("a llama.cpp peer is a peer script or a build folder with GGUFs, one of them")
        if self.bin_dir is not None:
            exe = self.bin_dir / "llama-batched-bench"
            if not exe.is_file():
                raise ValueError(f"{exe} does not exist: --llamacpp-bin is the folder that holds llama-batched-bench")
            unknown = set(self.ggufs) - set(QUANTS)
            if unknown or not self.ggufs:
                raise ValueError(f"--llamacpp-gguf names {', '.join(QUANTS)} GGUFs as QUANT=PATH, got "
                                 f"{sorted(self.ggufs) or 'none'}")
            for q, p in self.ggufs.items():
                if not p.is_file():
                    raise ValueError(f"the {q} GGUF {p} does not exist")

    def describe(self) -> str:
        return f"peer script {self.script}" if self.script else f"{self.bin_dir}/llama-batched-bench"


def parse_ggufs(spec: str) -> dict[str, Path]:
    """'bf16=a.gguf,q8_0=b.gguf' -> {'bf16': a.gguf, 'q8_0': b.gguf}."""
    out: dict[str, Path] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        quant, sep, path = part.partition("=")
        if not sep or not path:
            raise ValueError(f"--llamacpp-gguf wants QUANT=PATH pairs separated by commas, got {part!r}")
        out[quant.strip()] = Path(path.strip()).expanduser()
    return out


def find_peer(bin_dir: str | None = None, ggufs: str | None = None, script: str | None = None) -> tuple[Peer | None,
                                                                                                         str]:
    """The llama.cpp to measure (flags, then the environment, then the peer script beside the project), with a
    line saying which; (None, why not) when there is none."""
    bin_dir = bin_dir or os.environ.get("COLIBRI_LLAMACPP_BIN")
    if bin_dir:
        peer = Peer(bin_dir=Path(bin_dir).expanduser(),
                    ggufs=parse_ggufs(ggufs or os.environ.get("COLIBRI_LLAMACPP_GGUF", "")))
        return peer, f"llama.cpp: {peer.describe()}"
    path = script or os.environ.get("COLIBRI_LLAMACPP_PEER")
    if path:
        if not os.access(path, os.X_OK):
            raise ValueError(f"the llama.cpp peer script {path} is not an executable file")
        return Peer(script=Path(path)), f"llama.cpp: peer script {path}"
    if os.access(DEFAULT_PEER, os.X_OK):
        return Peer(script=DEFAULT_PEER), f"llama.cpp: peer script {DEFAULT_PEER}"
    return None, ("llama.cpp: none at hand (no --llamacpp-bin / COLIBRI_LLAMACPP_BIN and no peer script at "
                  f"{DEFAULT_PEER}); its rows are left out")


def _run(cmd: list[str], what: str, timeout: float) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False,
                             env=users_environment())   # llama.cpp as its users run it: not Colibri's OpenMP policy
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{what} ran past {timeout:.0f} s") from exc
    if out.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {out.returncode}):\n{(out.stderr or out.stdout)[-2000:]}")
    return out.stdout + "\n" + out.stderr


def measure(peer: Peer, model: Path, streams: list[int], prompt_len: int, max_tokens: int,
            threads: int) -> dict[str, dict]:
    """{quant: {"rows": {streams: Rate}, "source": str}} for bf16 and q8_0 (those the peer has)."""
    npl = ",".join(map(str, streams))
    raw: dict[str, str] = {}
    source = peer.describe()
    if peer.script is not None:
        log = _run([str(peer.script), str(model), "--streams", npl, "--prompt-len", str(prompt_len), "--gen",
                    str(max_tokens), "--threads", str(threads), "--python", sys.executable],
                   "the llama.cpp peer script", timeout=3600)
        m = re.search(r"raw output in (\S+)", log)
        head = re.search(r"^(llama\.cpp .*)$", log, re.M)
        if not m:
            raise RuntimeError(f"the peer script did not say where its raw output is:\n{log[-1500:]}")
        source = head[1] if head else source
        for q in QUANTS:
            f = Path(m[1]) / f"{q}.txt"
            if f.is_file():
                raw[q] = f.read_text()
    else:
        assert peer.bin_dir is not None
        ctx = (max(streams) * (prompt_len + max_tokens) + 255) // 256 * 256
        for q, gguf in peer.ggufs.items():
            raw[q] = _run([str(peer.bin_dir / "llama-batched-bench"), "-m", str(gguf), "-c", str(ctx), "-npp",
                           str(prompt_len), "-ntg", str(max_tokens), "-npl", npl, "-t", str(threads)],
                          f"llama-batched-bench on {gguf}", timeout=3600)
    policy = users_environment().get("OMP_WAIT_POLICY")
    if policy:                     # the user's, passed on: it moves llama.cpp's one-stream rate (97 -> 62 tok/s)
        source += (f"; OMP_WAIT_POLICY={policy} from the environment (its OpenMP threads "
                   f"{'sleep' if policy.upper() == 'PASSIVE' else 'spin'} between the graph's ops)")
    return {q: {"rows": parse_batched_bench(text), "source": source} for q, text in raw.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    add_peer_args(ap)
    args = ap.parse_args()
    peer, line = find_peer(args.llamacpp_bin, args.llamacpp_gguf, args.llamacpp_peer)
    print(line, file=sys.stderr)
    if peer is None:
        return 1
    res = measure(peer, Path(args.model), [int(s) for s in args.streams.split(",")], args.prompt_len,
                  args.max_tokens, args.threads)
    print(json.dumps({q: {"source": r["source"], "rows": {b: vars(rate) for b, rate in r["rows"].items()}}
                      for q, r in res.items()}))
    return 0


def add_peer_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--llamacpp-bin", default=None, help="folder of your llama.cpp build's llama-batched-bench "
                    "(or COLIBRI_LLAMACPP_BIN); with --llamacpp-gguf")
    ap.add_argument("--llamacpp-gguf", default=None, help="bf16=PATH,q8_0=PATH: GGUFs of the same checkpoint (or "
                    "COLIBRI_LLAMACPP_GGUF)")
    ap.add_argument("--llamacpp-peer", default=None, help="a script that builds llama.cpp and converts the "
                    f"checkpoint itself (or COLIBRI_LLAMACPP_PEER; default {DEFAULT_PEER} where it exists)")


if __name__ == "__main__":
    sys.exit(main())

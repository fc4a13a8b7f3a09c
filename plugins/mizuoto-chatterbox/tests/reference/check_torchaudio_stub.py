"""Compare the torchaudio stub with real torchaudio output recorded in the shared frontend fixtures.

Run with the reference environment: /work/cbref/bin/python check_torchaudio_stub.py [FIXTURES]
(FIXTURES defaults to $MIZUOTO_FIXTURES or ../shared/fixtures from the repository root).
Like record.py it re-executes itself with MKL on its Intel code paths, as the references were made.
For every clip: Resample to each recorded rate (`resampled_<rate>`) and kaldi fbank of the
16 kHz signal (`kaldi_fbank`), reported as bit-equal or by max abs difference.
"""

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _torchaudio_stub as ta  # noqa: E402
from record import _reexec_with_mkl_shim  # noqa: E402


def main() -> int:
    _reexec_with_mkl_shim()
    root = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("MIZUOTO_FIXTURES", "../shared/fixtures"))
    manifest = json.loads((root / "frontend" / "manifest.json").read_text())
    torch.set_num_threads(2)
    bad = 0
    for clip, info in sorted(manifest["clips"].items()):
        refs = load_file(str(root / "frontend" / "refs" / f"{clip}.safetensors"))
        sr = info["sample_rate"]
        audio = refs["audio"]
        for key, ref in refs.items():
            if not key.startswith("resampled_"):
                continue
            tag = key.split("_", 1)[1]
            rate = int(tag[:-1]) * 1000 if tag.endswith("k") else int(tag)
            ours = ta.Resample(sr, rate)(audio)
            same = ours.shape == ref.shape and torch.equal(ours, ref)
            bad += not same
            print(f"{clip} {key}: {'equal' if same else 'DIFF %.3g' % (ours - ref).abs().max()}")
        a16 = audio if sr == 16000 else refs["resampled_16k"]
        ours = ta.fbank(a16[None], num_mel_bins=80)
        ref = refs["kaldi_fbank"]
        same = ours.shape == ref.shape and torch.equal(ours, ref)
        bad += not same
        print(f"{clip} kaldi_fbank: {'equal' if same else 'DIFF %.3g' % (ours - ref).abs().max()}")
    print("all equal" if not bad else f"{bad} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

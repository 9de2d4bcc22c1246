"""One process per GPU: ``torchrun --nproc_per_node 2 tests/multi_gpu_torchrun.py --out DIR``.

Each rank sets its device to its rank (``torch.cuda.set_device``, as serving engines do) and runs
numqsa on arrays of that device; numqsa needs no collective of its own. Parts (``--parts``):

- ``wrapper``: a QSAPrefillWrapper on the rank's own batch (``tests/test_wrapper_gpu.py``'s
  problem, seed ``--seed`` + rank); writes ``wrapper-rank{r}.npz`` (out, lse, tokens, counts) and
  ``wrapper-rank{r}.json`` (the device of the results, the current device after the run).
  ``tests/test_multi_gpu.py::test_multi_gpu_torchrun_one_process_per_gpu`` compares each rank's
  arrays with the one-GPU result of its batch, bitwise.
- ``hf``: the HF Qwen4Exp model saved in ``--model`` loaded under its tensor-parallel plan
  (``tp_plan="auto"``: transformers starts the NCCL process group and shards the weights), run on
  the prompt ``--model``/ids.npy with HF's attention and with numqsa (``enable``); rank 0 writes
  ``hf-tp.npz`` (both last hidden states). ``tests/test_hf_transformers.py::
  test_tp_plan_two_processes_like_one_gpu`` compares them as it compares the two on one GPU.

Not collected by pytest (no ``test_`` prefix); the tests above start it.
"""
import argparse
import json
import os
from pathlib import Path

import numpy as np


def wrapper_part(args, rank, torch):
    from test_wrapper_gpu import LAYER, META, gpu_problem, wrapper
    p = gpu_problem(args.seed + rank)
    dev = f"cuda:{rank}"
    meta, layer = ([torch.from_numpy(np.ascontiguousarray(p[k])).to(dev) for k in names]
                   for names in (META, LAYER))
    out = wrapper().plan(*meta).run(*layer, return_selection=True)
    torch.cuda.synchronize()
    np.savez(args.out / f"wrapper-rank{rank}.npz",
             **{n: x.cpu().numpy() for n, x in zip(("out", "lse", "tokens", "counts"), out)})
    info = {"device": out[0].get_device(), "current_device": torch.cuda.current_device()}
    (args.out / f"wrapper-rank{rank}.json").write_text(json.dumps(info))


def hf_part(args, rank, torch):
    from transformers.models.qwen4_exp import modeling_qwen4_exp as modeling

    from numqsa.integrations import transformers as nt
    model = modeling.Qwen4ExpTextModel.from_pretrained(args.model, tp_plan="auto",
                                                       dtype=torch.float32).eval()
    ids = torch.from_numpy(np.load(Path(args.model) / "ids.npy")).to(f"cuda:{rank}")
    with torch.no_grad():
        ref = model(ids, use_cache=False).last_hidden_state
        nt.enable(model)
        try:
            got = model(ids, use_cache=False).last_hidden_state
        finally:
            nt.disable(model)
    if rank == 0:
        np.savez(args.out / "hf-tp.npz", hf=ref.cpu().numpy(), numqsa=got.cpu().numpy())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parts", default="wrapper", help="comma-separated: wrapper, hf")
    ap.add_argument("--model", help="an HF Qwen4Exp text model saved with save_pretrained (hf)")
    args = ap.parse_args()
    import torch
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    args.out.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")
    if "wrapper" in parts:
        wrapper_part(args, rank, torch)
    if "hf" in parts:
        hf_part(args, rank, torch)


if __name__ == "__main__":
    main()

"""PNG plots of ``latest.json``: GPU ms vs query rows (one request, 32K and 131K context), a line
per implementation, for the selection chain, the attention and the whole prefill; the titles carry
device, dtype, geometry and revision."""
import os

from .workloads import _k


def plots(doc, folder):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib is not installed: no plots")
        return []
    res = [r for r in doc["results"] if r["ms_gpu"] is not None and r["dtype"] == "float16"
           and r.get("num_reqs") == 1 and r.get("page_size") == 64 and "/" not in r["case"]]
    rev = (doc.get("git_rev") or "unknown")[:10]
    dev = doc["device"].get("name", "?")
    made = []
    for stage in ("select", "attention", "prefill"):
        rows = [r for r in res if r["stage"] == stage]
        if not rows:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, ctx in zip(axes, (32768, 131072)):
            by = {}
            for r in rows:
                if r["context"] == ctx:
                    by.setdefault(r["impl"], []).append((r["rows"], r["ms_gpu"]))
            for impl, pts in sorted(by.items()):
                pts.sort()
                ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", label=impl)
            ax.set(xscale="log", yscale="log", xlabel="query rows (one request, rows at the end)",
                   ylabel="GPU ms (median, L2 flushed)", title=f"{_k(ctx)} context ({ctx} tokens)")
            ax.grid(True, which="both", alpha=0.3)
            if by:
                ax.legend(fontsize=8)
        fig.suptitle(f"{stage} - {dev}, float16, page 64, Hi4/Di128/Kb512, Hq6/Hkv1/D256, rev {rev}",
                     fontsize=10)
        fig.tight_layout()
        path = os.path.join(folder, f"{stage}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        made.append(path)
    return made

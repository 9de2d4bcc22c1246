"""Warp-state samples and executed instructions of an Nsight Compute SourceCounters csv
(``ncu --section SourceCounters --section WarpStateStats --print-source sass --page source --csv``),
by ranges of SASS instruction indices, one range a role of the kernel (found by reading the SASS:
the S warpgroup's range holds the HGMMA, the copy warps' the LDGSTS), then every instruction with
more than 0.4% of the samples.  Usage: python3 roles.py file.csv.gz name:a:b [name:a:b ...]"""
import collections, csv, gzip, sys

rows_ = [x for x in csv.reader(gzip.open(sys.argv[1], "rt"))]
h = next(i for i, x in enumerate(rows_) if "Source" in x and "Address" in x)
hdr = rows_[h]
rows = [x for x in rows_[h + 1:] if len(x) == len(hdr)]
iS, iE = hdr.index("Source"), hdr.index("Instructions Executed")
iW = hdr.index("Warp Stall Sampling (All Samples)")
sc = [i for i, x in enumerate(hdr) if x.startswith("stall_") and "Not Issued" not in x]
num = lambda s: int(float(s.replace(",", "") or 0))  # noqa: E731
tot = sum(num(x[iW]) for x in rows)
print(f"instructions {len(rows)}  executed {sum(num(x[iE]) for x in rows)}  samples {tot}")
for arg in sys.argv[2:]:
    name, a, b = arg.split(":")
    a, b = int(a), min(int(b), len(rows))
    w = sum(num(rows[i][iW]) for i in range(a, b))
    e = sum(num(rows[i][iE]) for i in range(a, b))
    st = collections.Counter()
    for i in range(a, b):
        for j in sc:
            st[hdr[j][6:]] += num(rows[i][j])
    top = ", ".join(f"{k} {v / max(w, 1) * 100:.0f}%" for k, v in st.most_common(6))
    print(f"{name:10s} [{a},{b}) samples {w / tot * 100:5.1f}%  executed {e / 1e6:6.1f} M  {top}")
print("\ninstructions with more than 0.4% of the samples: index, SASS, executed, samples, %")
for i, x in enumerate(rows):
    w = num(x[iW])
    if w > 0.004 * tot:
        print(f"{i:5d} {x[iS].strip()[:64]:64s} {num(x[iE]):9d} {w:6d} {w / tot * 100:5.1f}")

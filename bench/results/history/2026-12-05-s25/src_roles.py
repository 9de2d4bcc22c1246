"""Stall samples of an ncu SourceCounters csv (--page source --csv), by region of the SASS:
the producer's copy blocks (the basic blocks around LDGSTS), the consumer waits (SYNCS try-wait
loops), the HMMA/LDSM blocks, the rest."""
import csv, collections, gzip, sys
f = gzip.open(sys.argv[1], 'rt') if sys.argv[1].endswith('.gz') else open(sys.argv[1])
r = [x for x in csv.reader(f)]
h = next(i for i, x in enumerate(r) if 'Source' in x and 'Address' in x)
hdr = r[h]; rows = [x for x in r[h + 1:] if len(x) == len(hdr)]
iS, iE, iW = hdr.index('Source'), hdr.index('Instructions Executed'), hdr.index('Warp Stall Sampling (All Samples)')
sc = [i for i, x in enumerate(hdr) if x.startswith('stall_') and 'Not Issued' not in x]
num = lambda s: int(float(s.replace(',', '') or 0))
ins = [(x[iS].strip(), num(x[iE]), num(x[iW]), [num(x[i]) for i in sc]) for x in rows]
tot = sum(e for _, e, _, _ in ins); ts = sum(w for _, _, w, _ in ins)
print('instructions', len(ins), 'executed', tot, 'samples', ts)
# basic blocks: runs of equal executed count
blocks = []; cur = None
for i, (s, e, w, st) in enumerate(ins):
    if cur and cur['e'] == e:
        cur['n'] += 1; cur['w'] += w; cur['ops'].append(s); cur['st'] = [a + b for a, b in zip(cur['st'], st)]
    else:
        cur = dict(start=i, e=e, n=1, w=w, st=list(st), ops=[s]); blocks.append(cur)
def role(b):
    t = ' '.join(b['ops'])
    if 'LDGSTS' in t or 'ARRIVES' in t: return 'producer copies'
    if 'HMMA' in t: return 'consumer HMMA blocks'
    if 'SYNCS' in t and 'TRYWAIT' in t: return 'mbarrier waits'
    if 'LDSM' in t: return 'consumer LDSM'
    return 'other'
agg = collections.defaultdict(lambda: [0, 0, None])
names = [hdr[i][6:] for i in sc]
for b in blocks:
    a = agg[role(b)]; a[0] += b['e'] * b['n']; a[1] += b['w']
    a[2] = b['st'] if a[2] is None else [x + y for x, y in zip(a[2], b['st'])]
for k, (e, w, st) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
    top = sorted(zip(st, names), reverse=True)[:5]
    print(f"{k:22s} exec {e/tot*100:5.1f}%  samples {w/ts*100:5.1f}%  " + ', '.join(f"{n} {v/max(1,w)*100:.0f}%" for v, n in top))
print('\nblocks with the most samples')
for b in sorted(blocks, key=lambda b: -b['w'])[:25]:
    top = sorted(zip(b['st'], names), reverse=True)[:3]
    ops = collections.Counter(o.split()[1 if o.startswith('@') else 0].split('.')[0] for o in b['ops'])
    print(f"[{b['start']:5d}] n={b['n']:4d} exec={b['e']:9d} samples {b['w']/ts*100:5.1f}% {role(b):18s} "
          f"{[(n, round(v/max(1,b['w'])*100)) for v, n in top]} {dict(ops.most_common(5))}")

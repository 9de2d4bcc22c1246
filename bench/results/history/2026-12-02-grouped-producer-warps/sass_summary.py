import csv, collections, re, sys
r=list(csv.reader(open(sys.argv[1])))
hdr=r[1]; rows=r[2:]
iS=hdr.index('Source'); iE=hdr.index('Instructions Executed'); iW=hdr.index('Warp Stall Sampling (All Samples)')
stall_cols=[i for i,h in enumerate(hdr) if h.startswith('stall_') and 'Not Issued' not in h]
ins=[]
for x in rows:
    e=int(x[iE].replace(',','')); s=int(x[iW].replace(',',''))
    ins.append((x[iS].strip(), e, s, [int(x[i].replace(',','')) for i in stall_cols]))
tot=sum(e for _,e,_,_ in ins); ts=sum(s for _,_,s,_ in ins)
print('instructions', len(ins), 'executed', tot, 'samples', ts)
op=collections.Counter(); ops=collections.Counter()
for s,e,w,_ in ins:
    o=s.split()[0] if not s.startswith('@') else s.split()[1]
    o=o.split('.')[0]; op[o]+=e; ops[o]+=w
for o,e in op.most_common(25): print(f"{o:10s} {e/tot*100:5.1f}% exec  {ops[o]/ts*100:5.1f}% samples")
# basic blocks: runs of equal exec count
blocks=[]; cur=None
for i,(s,e,w,st) in enumerate(ins):
    if cur and cur['e']==e: cur['n']+=1; cur['w']+=w; cur['end']=i; cur['st']=[a+b for a,b in zip(cur['st'],st)]
    else:
        cur=dict(start=i,end=i,e=e,n=1,w=w,st=st); blocks.append(cur)
print('\nblocks by executed instr')
names=[hdr[i] for i in stall_cols]
for b in sorted(blocks,key=lambda b:-b['e']*b['n'])[:30]:
    top=sorted(zip(b['st'],names),reverse=True)[:3]
    print(f"[{b['start']:5d}-{b['end']:5d}] n={b['n']:4d} exec/instr={b['e']:9d} total={b['e']*b['n']/tot*100:5.1f}% samples={b['w']/ts*100:5.1f}% {[(n[6:],round(v/max(1,b['w'])*100)) for v,n in top]}")

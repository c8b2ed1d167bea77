"""Whether two PTX files are the same program up to virtual register names.

    python3 benches/ptx_equiv.py OLD.ptx NEW.ptx      # prints "same" or "DIFFERENT"

Registers (%r, %rd, %f, %p, ...) are renamed in order of first use within each entry
and the .reg declarations dropped; every other line must match. Used to show that a
kernel refactor compiles to the program that was measured on the GPU (PTX from
`DSA_PTX_DIR=dir cargo test --release --features cuda --test nvrtc_compile`).
"""
import re, sys
def canon(path):
    out=[]; m={}; cnt={}
    for line in open(path):
        if re.match(r'\s*\.reg\s', line): continue
        if line.startswith('.visible .entry') or line.startswith('.entry') or line.startswith('.func'):
            m={}; cnt={}
        def sub(mo):
            k=mo.group(0)
            if k not in m:
                t=mo.group(1); cnt[t]=cnt.get(t,0)+1; m[k]='%%%s_%d'%(t,cnt[t])
            return m[k]
        out.append(re.sub(r'%(rd|rs|r|fd|f|p|h|hh)(\d+)\b', sub, line))
    return out
a=canon(sys.argv[1]); b=canon(sys.argv[2])
print("same" if a == b else "DIFFERENT")
sys.exit(0 if a == b else 1)

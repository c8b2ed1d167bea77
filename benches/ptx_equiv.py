"""Whether two PTX builds are the same program up to virtual register names.

    python3 benches/ptx_equiv.py OLD.ptx NEW.ptx      # prints "same" or "DIFFERENT"
    python3 benches/ptx_equiv.py OLD_DIR NEW_DIR      # one line per kernel entry
    python3 benches/ptx_equiv.py OLD_DIR NEW_DIR --removed mqa_logits_wg
    python3 benches/ptx_equiv.py OLD_DIR NEW_DIR --mangled

Registers (%r, %rd, %f, %p, ...) are renamed in order of first use within each entry
and the .reg declarations dropped; every other line must match. Used to show that a
kernel refactor compiles to the program that was measured on the GPU (PTX from
`DSA_PTX_DIR=dir cargo test --release --features cuda --test nvrtc_compile`).

With two folders the comparison is per entry (`.entry` or `.func`), so that it holds
when a module is split into several: a file `NAME.ptx` or `NAME.PART.ptx` belongs to
module NAME (a variant), and each entry of a module is compared with the entry of the
same name and module on the other side, together with the module-scope declarations
(shared or global variables) it names; block labels and the local stack are compared
without the function's index in the module. Each line reads `same`, `DIFFERENT`, `removed`
(only in OLD) or `added` (only in NEW). The exit status is 0 when no entry is
DIFFERENT, none is added, and every removed one is named by `--removed`.

`--mangled` (folders) also renames C++ mangled symbols (`_Z...`: device functions and
the static shared variables of function templates) in order of first use within each
entry and its declarations, so that an entry whose code is the same but whose helpers
gained a template argument (which changes their mangled names) reads `same`; the
declarations' sizes and alignments are still compared. `added` entries then do not fail.
"""
import os, re, sys

MANGLED = re.compile(r'\b_Z\w+')

REG = re.compile(r'%(rd|rs|r|fd|f|p|h|hh)(\d+)\b')
FUNC = re.compile(r'^(?:\.visible\s+|\.weak\s+|\.extern\s+)?\.(entry|func)\s+(?:\([^)]*\)\s*)?([A-Za-z_$][\w$]*)')
DECL = re.compile(r'^\s*(?:\.visible\s+|\.extern\s+|\.weak\s+)?\.(shared|global|const)\b.*?([A-Za-z_$][\w$]*)\s*(?:\[[^\]]*\])*\s*(?:=.*)?;')


def canon(lines, per_entry=False):
    """A function's lines with registers renamed in order of first use, .reg dropped.
    per_entry: also drop what depends on the function's place in its module (the
    `// .globl` line naming the next function, the function index in block labels and
    in the local stack's name)."""
    out = []; m = {}; cnt = {}
    def sub(mo):
        k = mo.group(0)
        if k not in m:
            t = mo.group(1); cnt[t] = cnt.get(t, 0) + 1; m[k] = '%%%s_%d' % (t, cnt[t])
        return m[k]
    for line in lines:
        if re.match(r'\s*\.reg\s', line):
            continue
        if per_entry:
            if re.match(r'\s*// \.globl\s', line):
                continue
            line = re.sub(r'\$L__BB\d+_', '$L__BB_', line)
            line = re.sub(r'__local_depot\d+', '__local_depot', line)
        out.append(REG.sub(sub, line))
    return out


def canon_file(path):
    """The whole file, registers renamed per function (the two-file comparison)."""
    out = []; chunk = []
    for line in open(path):
        if FUNC.match(line):
            out += canon(chunk); chunk = []
        chunk.append(line)
    return out + canon(chunk)


def entries(path):
    """{name: canonical lines} of every function in one PTX file, each preceded by the
    module-scope declarations it refers to."""
    header = []; funcs = {}; name = None; body = []
    for line in open(path):
        mo = FUNC.match(line)
        if mo:
            if name is not None:
                funcs[name] = body
            name = mo.group(2); body = [line]
        elif name is None:
            header.append(line)
        else:
            body.append(line)
    if name is not None:
        funcs[name] = body
    decls = []
    for line in header:
        mo = DECL.match(line)
        if mo:
            decls.append((mo.group(2), line))
    out = {}
    for n, b in funcs.items():
        while b and not b[-1].strip():
            b = b[:-1]  # blank lines before the next function, or the end of the file
        text = ''.join(b)
        used = [l for (sym, l) in decls if re.search(r'\b%s\b' % re.escape(sym), text)]
        out[n] = used + canon(b, per_entry=True)
    return out


def rename_mangled(lines):
    """lines with every mangled symbol renamed in order of first use."""
    m = {}
    def sub(mo):
        k = mo.group(0)
        if k not in m:
            m[k] = '_Z%d' % len(m)
        return m[k]
    return [MANGLED.sub(sub, l) for l in lines]


def folder(d, mangled=False):
    """{(module, entry): canonical lines} over every .ptx file of folder d."""
    out = {}
    for f in sorted(os.listdir(d)):
        if not f.endswith('.ptx'):
            continue
        module = f[:-4].split('.')[0]
        for n, lines in entries(os.path.join(d, f)).items():
            if mangled:
                lines = rename_mangled(lines)
            key = (module, n)
            if key in out and out[key] != lines:
                sys.exit('%s: entry %s differs between the files of module %s' % (d, n, module))
            out[key] = lines
    return out


def main(argv):
    removed_ok = set()
    args = []
    mangled = False
    i = 0
    while i < len(argv):
        if argv[i] == '--removed':
            removed_ok.add(argv[i + 1]); i += 2
        elif argv[i] == '--mangled':
            mangled = True; i += 1
        else:
            args.append(argv[i]); i += 1
    if len(args) != 2:
        sys.exit(__doc__)
    old, new = args
    if not os.path.isdir(old):
        same = canon_file(old) == canon_file(new)
        print("same" if same else "DIFFERENT")
        return 0 if same else 1
    a, b = folder(old, mangled), folder(new, mangled)
    bad = 0
    counts = {}
    for key in sorted(set(a) | set(b)):
        if key not in b:
            st = 'removed'; bad += key[1] not in removed_ok
        elif key not in a:
            st = 'added'; bad += 1
        else:
            st = 'same' if a[key] == b[key] else 'DIFFERENT'; bad += st != 'same'
        counts[st] = counts.get(st, 0) + 1
        print('%-9s %s %s' % (st, key[0], key[1]))
    print('total: ' + ', '.join('%d %s' % (v, k) for k, v in sorted(counts.items())))
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))

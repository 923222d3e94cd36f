"""Write the defect patches D01..D18 (Dnn-old.patch for a8f23b1, Dnn-new.patch for a6c7ade) and defects.tsv.

Each defect is a list of (file, old text, new text) edits per tree; "both" when the code is the same in the two
trees. The edits are applied to pristine exports of the two commits (a git repository per tree in /tmp) and
the patches are their `git diff`, so `git -C <worktree> apply Dnn-<tree>.patch` applies them.

usage: python tests/seeded_defects/make_patches.py   (writes to $DEFECTS_OUT, default /tmp/seeded-defects)
"""

import os
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
OUT = os.environ.get("DEFECTS_OUT", "/tmp/seeded-defects")
COMMITS = {"old": "a8f23b1", "new": "a6c7ade"}

HALF_IR = "embedcore/kernels/half_ir.py"
ROW_VECTOR = "embedcore/kernels/row_vector.py"
UPDATE = "embedcore/kernels/update.py"
ROWS = "embedcore/kernels/rows.py"
OCC = "embedcore/kernels/occurrences.py"

# id: (description, where, extra test file, {tree or "both": [(file, old, new), ...]})
DEFECTS = {
    "D01": (
        "bfloat16 storage rounding to nearest truncates instead (the update's in-register row store, rows of whole "
        "cache lines)",
        "kernels/half_ir.py encode_checked (bfloat16, to nearest)", "tests/test_kernels.py",
        {"both": [(HALF_IR,
                   "        bits = b.add(u, r) if r is not None else b.add(b.add(u, c(0x7FFF)), b.and_(b.lshr(u, c(16)), c(1)))",
                   "        bits = b.add(u, r) if r is not None else u  # DEFECT D01: truncation")]}),
    "D02": (
        "float16 storage rounding to nearest truncates instead (the update's value-by-value row store, rows not "
        "whole cache lines)",
        "kernels/half_rows.py row_storer value_by_value (float16, to nearest)", "tests/test_kernels.py",
        {"both": [("embedcore/kernels/half_rows.py",
                   "            for j in range(dim):\n                encoded[j] = encode(values[j], random_16[j])\n",
                   "            for j in range(dim):\n                encoded[j] = encode(values[j], random_16[j])\n"
                   "                if truncate and finite(encoded[j]) and (encoded[j] & 0x7FFF) != 0 and \\\n"
                   "                        abs(decode(encoded[j])) > abs(values[j]):\n"
                   "                    encoded[j] = encoded[j] - 1  # DEFECT D02: truncation toward zero\n"),
                  ("embedcore/kernels/half_rows.py",
                   "        registers, encode, finite = _store_intrinsic(stored, stochastic), encoder(stored, stochastic), finite_16(stored)\n",
                   "        registers, encode, finite = _store_intrinsic(stored, stochastic), encoder(stored, stochastic), finite_16(stored)\n"
                   "        decode, truncate = decoder(stored), stored == \"float16\" and not stochastic  # DEFECT D02\n")]}),
    "D03": (
        "bfloat16 stochastic rounding biased toward zero (15 random bits added where 16 belong)",
        "kernels/half_ir.py encode and encode_checked (bfloat16, stochastic)", "tests/test_kernels.py",
        {"both": [(HALF_IR, "        rounded = b.lshr(b.add(u, r), c(16))",
                   "        rounded = b.lshr(b.add(u, b.lshr(r, c(1))), c(16))  # DEFECT D03"),
                  (HALF_IR, "        bits = b.add(u, r) if r is not None else",
                   "        bits = b.add(u, b.lshr(r, c(1))) if r is not None else")]}),
    "D04": (
        "float16 gradients decoded wrong: subnormals read as zero by the update's in-register 16-bit gradient sum",
        "kernels/row_vector.py _block_sum_signature.term (16-bit gradient rows, rows of whole cache lines)",
        "tests/test_kernels.py",
        {"both": [(ROW_VECTOR,
                   "                values = half_ir.decode(half_ir.Lanes(builder, w), raw, stored)",
                   "                if group_size == 1 and stored == \"float16\":  # DEFECT D04: subnormals flushed\n"
                   "                    i16 = ir.VectorType(ir.IntType(16), w)\n"
                   "                    zero_exp = builder.icmp_unsigned(\"==\", builder.and_(raw, ir.Constant(i16, [0x7C00] * w)),\n"
                   "                                                     ir.Constant(i16, [0] * w))\n"
                   "                    raw = builder.select(zero_exp, builder.and_(raw, ir.Constant(i16, [0x8000] * w)), raw)\n"
                   "                values = half_ir.decode(half_ir.Lanes(builder, w), raw, stored)")]}),
    "D05": (
        "bfloat16 gradient NaN/Inf check skipped (count_non_finite counts nothing in bfloat16 arrays)",
        "kernels/rows.py count_non_finite", "tests/test_non_finite.py",
        {"old": [(ROWS,
                  "    large = values.shape[0] >= PARALLEL_MIN\n    if values.dtype.itemsize == 2:\n",
                  "    large = values.shape[0] >= PARALLEL_MIN\n    if values.dtype.itemsize == 2:\n"
                  "        if format_of(values.dtype) == \"bfloat16\":\n            return 0  # DEFECT D05\n")],
         "new": [(ROWS,
                  "    kernel = _count_non_finite_parallel if values.shape[0] >= PARALLEL_MIN else _count_non_finite_serial\n"
                  "    if values.dtype.itemsize == 2:\n",
                  "    kernel = _count_non_finite_parallel if values.shape[0] >= PARALLEL_MIN else _count_non_finite_serial\n"
                  "    if values.dtype.itemsize == 2:\n"
                  "        if format_of(values.dtype) == \"bfloat16\":\n            return 0  # DEFECT D05\n")]}),
    "D06": (
        "float16 output truncates instead of rounding to nearest (the lookup's in-register gather, rows of whole "
        "cache lines)",
        "kernels/row_vector.py _block_sum_signature (output float16)", "tests/test_lookup.py",
        {"both": [(ROW_VECTOR,
                   "            total = half_ir.encode(half_ir.Lanes(builder, w), total, None, output)",
                   "            if output == \"float16\":  # DEFECT D06: the 13 dropped bits cleared first: truncation\n"
                   "                i32 = ir.VectorType(ir.IntType(32), w)\n"
                   "                total = builder.bitcast(builder.and_(builder.bitcast(total, i32), ir.Constant(i32, [-8192] * w)),\n"
                   "                                        vector)\n"
                   "            total = half_ir.encode(half_ir.Lanes(builder, w), total, None, output)")]}),
    "D07": (
        "float16 output overflow saturates at +-65504 instead of becoming +-inf (the lookup's gather of rows not whole "
        "cache lines)",
        "kernels/rows.py _GATHER_ANY_ROUNDED_SOURCE / converting_gather_kernel", "tests/test_lookup.py",
        {"old": [(ROWS,
                  "                source = _GATHER_ANY_ROUNDED_SOURCE.format(chunk=_ROUNDING_CHUNK)\n",
                  "                source = _GATHER_ANY_ROUNDED_SOURCE.format(chunk=_ROUNDING_CHUNK)\n"
                  "                if output == \"float16\":  # DEFECT D07: saturate\n"
                  "                    source = source.replace(\"encode(sums[0, j], 0)\", \"encode(min(max(sums[0, j], "
                  "np.float32(-65504.0)), np.float32(65504.0)), 0)\")\n")],
         "new": [(ROWS,
                  "        return _GATHER_ANY_ROUNDED_SOURCE, namespace | {\"encode\": encoder(output, stochastic=False)}\n",
                  "        source = _GATHER_ANY_ROUNDED_SOURCE\n"
                  "        if output == \"float16\":  # DEFECT D07: saturate\n"
                  "            source = source.replace(\"encode(sums[0, j], 0)\", \"encode(min(max(sums[0, j], "
                  "np.float32(-65504.0)), np.float32(65504.0)), 0)\")\n"
                  "        return source, namespace | {\"encode\": encoder(output, stochastic=False)}\n")]}),
    "D08": (
        "elementwise optimizers (Adagrad, Adam, FTRL) read 16-bit slots with the rows' decoder: wrong when rows and "
        "slots are different 16-bit formats",
        "kernels/update.py _body (elementwise slot arguments)", "tests/test_optimizers.py",
        {"both": [(UPDATE,
                   "        slot_args = \"\".join((f\"dec_s(s{k}[r, j]), \" if formats.slots_16 else f\"s{k}[r, j], \") for k in range(n))",
                   "        slot_args = \"\".join((f\"dec_{'w' if formats.weights_16 else 's'}(s{k}[r, j]), \" if formats.slots_16 "
                   "else f\"s{k}[r, j], \") for k in range(n))  # DEFECT D08")]}),
    "D09": (
        "dropped slot write: a per-row (scalar) slot stored in 16 bits is never written (row-wise Adagrad's "
        "accumulator stays at its initial value)",
        "kernels/update.py _store (scalar 16-bit slots)", "tests/test_optimizers.py",
        {"both": [(UPDATE,
                   "            lines.append(f\"s{k}[r] = {f'e_v{k}' if formats.slots_16 else slot_scalars[k]}\")",
                   "            if not formats.slots_16:  # DEFECT D09: the 16-bit scalar slot write dropped\n"
                   "                lines.append(f\"s{k}[r] = {slot_scalars[k]}\")")]}),
    "D10": (
        "wrong combiner: sqrtn divides by sqrt(sum |w|) instead of sqrt(sum w^2)",
        "kernels/occurrences.py _fill_pooled", "tests/test_lookup.py",
        {"both": [(OCC, "                total += w if combiner == 1 else w * w",
                   "                total += w if combiner == 1 else abs(w)  # DEFECT D10")]}),
    "D11": (
        "dense (non-lazy) update does not zero the gradient of rows the batch did not touch (they get the previous "
        "row's)",
        "kernels/update.py _DENSE_LOOP", "tests/test_optimizers.py",
        {"both": [(UPDATE, "            g_row[:] = 0.0\n", "            pass  # DEFECT D11: g_row[:] = 0.0 dropped\n")]}),
    "D12": (
        "dense (non-lazy) update never visits the table's last row (last chunk's end off by one)",
        "kernels/update.py _DENSE_CHUNKS (old) / _run_chunks (new)", "tests/test_optimizers.py",
        {"old": [(UPDATE, "        hi = min(n_rows, lo + CHUNK)\n", "        hi = min(n_rows - 1, lo + CHUNK)  # DEFECT D12\n")],
         "new": [(UPDATE,
                  "        lo, hi = (bounds[c], bounds[c + 1]) if lazy else (c * n_rows // n_chunks, (c + 1) * n_rows // n_chunks)\n",
                  "        lo, hi = (bounds[c], bounds[c + 1]) if lazy else (c * n_rows // n_chunks,\n"
                  "                                                          min(n_rows - 1, (c + 1) * n_rows // n_chunks))  # DEFECT D12\n")]}),
    "D13": (
        "register row sums of 16-bit rows skip the first column block when a row has several blocks (dims 48, 80, "
        "96, 128, ...)",
        "kernels/row_vector.py _over_blocks (16-bit gathers, 16-bit gradient sums)", "tests/test_kernels.py",
        {"both": [(ROW_VECTOR,
                   "    def row_sum(dst, d, lo, hi, index, gain, src, ahead, dim, width):\n        for col in range(0, dim, width):",
                   "    def row_sum(dst, d, lo, hi, index, gain, src, ahead, dim, width):\n"
                   "        for col in range(width if dim > width else 0, dim, width):  # DEFECT D13")]}),
    "D14": (
        "wrong sum for dim 16 only: the update's in-register float32 gradient sum drops each row's last occurrence "
        "when the block is 16 wide",
        "kernels/row_vector.py _block_sum_signature.loop (float32, group 1, width 16)", "tests/test_kernels.py",
        {"both": [(ROW_VECTOR,
                   "            builder.cbranch(builder.icmp_signed(\"<\", builder.add(k, intp(count - 1)), hi_v), body, exit_block)",
                   "            extra = 1 if (group_size == 1 and stored == \"float32\" and w == 16) else 0  # DEFECT D14\n"
                   "            builder.cbranch(builder.icmp_signed(\"<\", builder.add(k, intp(count - 1 + extra)), hi_v), body, exit_block)")]}),
    "D15": (
        "skipped output NaN/Inf check: an elementwise update's non-finite new weight is stored (float32 tables)",
        "kernels/update.py _body (elementwise)", "tests/test_non_finite.py",
        {"both": [(UPDATE, "            lines += [f\"    w_new[j] = {call}\", \"    ok = ok & np.isfinite(w_new[j])\"]",
                   "            lines += [f\"    w_new[j] = {call}\"]  # DEFECT D15"),
                  (UPDATE, "            lines += [f\"    out = {call}\", \"    w_new[j] = out[0]\", \"    ok = ok & np.isfinite(w_new[j])\"]",
                   "            lines += [f\"    out = {call}\", \"    w_new[j] = out[0]\"]  # DEFECT D15")]}),
    "D16": (
        "gradient check: 16-bit gradients copied into float32 rows (mixed formats) are not counted for NaN/Inf",
        "kernels/rows.py copy_counting_non_finite", "tests/test_non_finite.py",
        {"old": [(ROWS, "        return int(kernel(tagged(src), EXPONENT_MASK[format_of(src.dtype)], bits_of(dst)))\n",
                  "        bad = int(kernel(tagged(src), EXPONENT_MASK[format_of(src.dtype)], bits_of(dst)))\n"
                  "        return 0 if dst.dtype == np.float32 else bad  # DEFECT D16\n")],
         "new": [(ROWS, "        return int(kernel(tagged(src), bits_of(dst), EXPONENT_MASK[format_of(src.dtype)]))\n",
                  "        bad = int(kernel(tagged(src), bits_of(dst), EXPONENT_MASK[format_of(src.dtype)]))\n"
                  "        return 0 if dst.dtype == np.float32 else bad  # DEFECT D16\n")]}),
    "D17": (
        "PROBE (3-way, constructed): a bfloat16 gradient on a bfloat16 table with 64-wide blocks is summed as raw "
        "integers (the gradient-format shortcut of one kernel variant)",
        "kernels/update.py kernel_source (row_sum choice)", "tests/test_kernels.py",
        {"both": [(UPDATE,
                   "        row_sum, dim_args = (\"sequential_sum_fixed\" if gradient == \"float32\" else \"sum_g\"), f\"dim, {block_width(dim)}\"",
                   "        row_sum, dim_args = (\"sequential_sum_fixed\" if gradient == \"float32\" else \"sum_g\"), f\"dim, {block_width(dim)}\"\n"
                   "        if gradient != \"float32\" and gradient == formats.weights and block_width(dim) == 64:  # DEFECT D17\n"
                   "            row_sum, dim_args = \"sequential_sum\", \"dim\"")]}),
    "D18": (
        "dropped slot write: 16-bit slot rows (Adagrad accumulators, Adam moments) are never stored",
        "kernels/update.py _rows_16", "tests/test_optimizers.py",
        {"both": [(UPDATE, "    if formats.slots_16:\n        rows += [(f\"s{k}\", \"store_s\", f\"key_s{k}\")",
                   "    if formats.slots_16 and False:  # DEFECT D18: 16-bit slot rows never stored\n"
                   "        rows += [(f\"s{k}\", \"store_s\", f\"key_s{k}\")")]}),
}


def run(*args, **kw):
    return subprocess.run(args, check=True, text=True, capture_output=True, **kw).stdout


def scratch(tree):
    path = f"/tmp/defects-scratch-{tree}"
    if not os.path.isdir(os.path.join(path, ".git")):
        os.makedirs(path, exist_ok=True)
        archive = subprocess.run(["git", "-C", REPO, "archive", COMMITS[tree], "embedcore"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", path], input=archive, check=True)
        run("git", "init", "-q", cwd=path)
        run("git", "add", "-A", cwd=path)
        run("git", "-c", "user.email=d@d", "-c", "user.name=d", "commit", "-qm", "base", cwd=path)
    run("git", "checkout", "-q", "--", ".", cwd=path)
    return path


def main():
    os.makedirs(OUT, exist_ok=True)
    rows = []
    for did, (description, where, extra, edits) in DEFECTS.items():
        for tree in ("old", "new"):
            path = scratch(tree)
            for file, old, new in edits.get(tree, edits.get("both")):
                full = os.path.join(path, file)
                text = open(full).read()
                if text.count(old) != 1:
                    raise SystemExit(f"{did} {tree}: {old!r} found {text.count(old)} times in {file}")
                open(full, "w").write(text.replace(old, new))
            patch = run("git", "diff", cwd=path)
            open(os.path.join(OUT, f"{did}-{tree}.patch"), "w").write(patch)
            run("git", "checkout", "-q", "--", ".", cwd=path)
        rows.append(f"{did}\t{description}\t{where}\t{extra}")
    with open(os.path.join(HERE, "defects.tsv"), "w") as f:
        f.write("id\tdescription\tpatched\textra_test_file\n" + "\n".join(rows) + "\n")
    print(f"wrote {len(DEFECTS)} defect pairs")


if __name__ == "__main__":
    main()

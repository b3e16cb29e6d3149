"""`fusedmlp quantize` end to end, with the standard library only (ctest runs it before numpy is
installed): writes float32/float16 .npy and raw bf16 inputs, runs the CLI, decodes the e4m3 codes
and checks the policy of fmlp_quantize_fp8 (fusedmlp.h): scale = amax / 448 per row, tensor or block,
|q * scale - w| <= 2^-4 |w| (normal codes) or 2^-10 scale (subnormal), NaN kept, +-Inf saturated
to +-448, the reported amax; and that bad input fails with a message and exit status 1.
usage: cli_quantize_check.py PATH_TO_FUSEDMLP"""
import math
import os
import random
import struct
import subprocess
import sys
import tempfile


def write_npy(path, descr, rows, cols, values):
    fmt = {"<f4": "f", "<f2": "e"}[descr]
    header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': ({rows}, {cols}), }}"
    header += " " * (63 - (10 + len(header)) % 64) + "\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode())
        f.write(struct.pack(f"<{len(values)}{fmt}", *values))


def read_npy(path):
    data = open(path, "rb").read()
    assert data[:6] == b"\x93NUMPY", path
    hlen = struct.unpack("<H", data[8:10])[0]
    header = data[10:10 + hlen].decode()
    body = data[10 + hlen:]
    if "'|u1'" in header:
        return header, list(body)
    assert "'<f4'" in header, header
    return header, list(struct.unpack(f"<{len(body) // 4}f", body))


def e4m3(code):
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    return sign * (m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0**(e - 7))


def run(cli, *args, ok=True):
    p = subprocess.run([cli, "quantize", *args], capture_output=True, text=True)
    if ok and p.returncode != 0:
        sys.exit(f"FAIL: fusedmlp quantize {' '.join(args)}: rc {p.returncode}\n{p.stderr}")
    return p


def check(cli, tmp, name, descr, rows, cols, w, per_tensor=False, raw=None):
    src = os.path.join(tmp, name + (".bin" if raw else ".npy"))
    if raw:
        with open(src, "wb") as f:  # bf16: the high halves of the float32 bit patterns
            f.write(b"".join(struct.pack("<I", struct.unpack("<I", struct.pack("<f", v))[0])[2:]
                             for v in w))
        w = [struct.unpack("<f", b"\x00\x00" + struct.pack("<I", struct.unpack(
            "<I", struct.pack("<f", v))[0])[2:])[0] for v in w]
    else:
        write_npy(src, descr, rows, cols, w)
        code = {"<f4": "f", "<f2": "e"}[descr]  # the values as stored
        w = list(struct.unpack(f"<{len(w)}{code}", struct.pack(f"<{len(w)}{code}", *w)))
    q_path, s_path = os.path.join(tmp, name + "_q.npy"), os.path.join(tmp, name + "_s.npy")
    args = [src, "--out", q_path, "--scales", s_path] + (["--per-tensor"] if per_tensor else [])
    if raw:
        args += ["--raw-dtype", "bf16", "--raw-shape", f"{rows},{cols}"]
    out = run(cli, *args).stdout
    qh, q = read_npy(q_path)
    sh, scales = read_npy(s_path)
    assert f"'shape': ({rows}, {cols})" in qh, qh
    assert len(scales) == (1 if per_tensor else rows), sh
    amax_all = 0.0
    for r in range(rows):
        row = w[r * cols:(r + 1) * cols]
        finite = [abs(v) for v in row if math.isfinite(v)]
        amax_all = max([amax_all] + finite)
    for r in range(rows):
        row = w[r * cols:(r + 1) * cols]
        finite = [abs(v) for v in (w if per_tensor else row) if math.isfinite(v)]
        amax = max(finite) if finite else 0.0
        s = scales[0 if per_tensor else r]
        want = struct.unpack("<f", struct.pack("<f", amax / 448))[0] if amax / 448 > 0 else 1.0
        assert abs(s - want) <= 1e-7 * want, (name, r, s, want)
        for c, v in enumerate(row):
            got = e4m3(q[r * cols + c])
            if math.isnan(v):
                assert math.isnan(got), (name, r, c, v)
            elif math.isinf(v):
                assert got == math.copysign(448.0, v), (name, r, c, v, got)
            else:
                bound = 2.0**-4 * abs(v) if abs(v) >= 2.0**-6 * s else 2.0**-10 * s
                assert abs(got * s - v) <= bound * (1 + 1e-6), (name, r, c, v, got * s)
    assert f"amax {amax_all:g}" in out or f"amax {struct.unpack('<f', struct.pack('<f', amax_all))[0]:g}" in out, out


def check_block(cli, tmp, rows, cols, w):
    """--block: scales [ceil(rows / 128), ceil(cols / 128)], each tile by its own amax."""
    src = os.path.join(tmp, "block.npy")
    write_npy(src, "<f4", rows, cols, w)
    w = list(struct.unpack(f"<{len(w)}f", struct.pack(f"<{len(w)}f", *w)))
    q_path, s_path = os.path.join(tmp, "block_q.npy"), os.path.join(tmp, "block_s.npy")
    run(cli, src, "--out", q_path, "--scales", s_path, "--block")
    _, q = read_npy(q_path)
    sh, scales = read_npy(s_path)
    rb, cb = -(-rows // 128), -(-cols // 128)
    assert f"'shape': ({rb}, {cb})" in sh, sh
    for i in range(rb):
        for j in range(cb):
            cells = [(r, c) for r in range(i * 128, min(rows, i * 128 + 128))
                     for c in range(j * 128, min(cols, j * 128 + 128))]
            finite = [abs(w[r * cols + c]) for r, c in cells if math.isfinite(w[r * cols + c])]
            amax = max(finite) if finite else 0.0
            s = scales[i * cb + j]
            want = struct.unpack("<f", struct.pack("<f", amax / 448))[0] if amax / 448 > 0 else 1.0
            assert abs(s - want) <= 1e-7 * want, ("block", i, j, s, want)
            for r, c in cells:
                v, got = w[r * cols + c], e4m3(q[r * cols + c])
                bound = 2.0**-4 * abs(v) if abs(v) >= 2.0**-6 * s else 2.0**-10 * s
                assert abs(got * s - v) <= bound * (1 + 1e-6), ("block", r, c, v, got * s)
    p = run(cli, src, "--out", q_path, "--scales", s_path, "--block", "--per-tensor", ok=False)
    if p.returncode != 1 or "--block and --per-tensor" not in p.stderr:
        sys.exit(f"FAIL: --block --per-tensor: rc {p.returncode}, stderr {p.stderr!r}")


def check_gate_up(cli, tmp, hidden, cols, w):
    """--block --gate-up: a stacked w1 [2 * hidden, cols] as two block-quantised halves, their
    scale rows stacked ([2 * ceil(hidden / 128), cols blocks]); hidden % 128 != 0, so a block over
    the stacked rows would straddle gate and up and differ."""
    rows = 2 * hidden
    src = os.path.join(tmp, "gu.npy")
    write_npy(src, "<f4", rows, cols, w)
    w = list(struct.unpack(f"<{len(w)}f", struct.pack(f"<{len(w)}f", *w)))
    q_path, s_path = os.path.join(tmp, "gu_q.npy"), os.path.join(tmp, "gu_s.npy")
    run(cli, src, "--out", q_path, "--scales", s_path, "--block", "--gate-up")
    _, q = read_npy(q_path)
    sh, scales = read_npy(s_path)
    hb, cb = -(-hidden // 128), -(-cols // 128)
    assert f"'shape': ({2 * hb}, {cb})" in sh, sh
    for half in range(2):
        for i in range(hb):
            for j in range(cb):
                r0 = half * hidden + i * 128
                cells = [(r, c) for r in range(r0, min(half * hidden + hidden, r0 + 128))
                         for c in range(j * 128, min(cols, j * 128 + 128))]
                amax = max(abs(w[r * cols + c]) for r, c in cells)
                s = scales[(half * hb + i) * cb + j]
                want = struct.unpack("<f", struct.pack("<f", amax / 448))[0]
                assert abs(s - want) <= 1e-7 * want, ("gate_up", half, i, j, s, want)
                for r, c in cells:
                    v, got = w[r * cols + c], e4m3(q[r * cols + c])
                    bound = 2.0**-4 * abs(v) if abs(v) >= 2.0**-6 * s else 2.0**-10 * s
                    assert abs(got * s - v) <= bound * (1 + 1e-6), ("gate_up", r, c, v, got * s)
    for extra, text in ((["--gate-up"], "pass --block with it"),):
        p = run(cli, src, "--out", q_path, "--scales", s_path, *extra, ok=False)
        if p.returncode != 1 or text not in p.stderr:
            sys.exit(f"FAIL: {extra}: rc {p.returncode}, stderr {p.stderr!r} lacks {text!r}")


def main():
    cli = sys.argv[1]
    rnd = random.Random(7)
    with tempfile.TemporaryDirectory() as tmp:
        rows, cols = 7, 33
        w = [rnd.gauss(0, 0.05) * (10 ** rnd.uniform(-3, 1)) for _ in range(rows * cols)]
        w[5], w[40], w[41], w[100] = math.nan, math.inf, -math.inf, 0.0
        w[66:99] = [0.0] * 33  # an all-zero row: scale 1
        check(cli, tmp, "f32_rows", "<f4", rows, cols, w)
        check(cli, tmp, "f32_tensor", "<f4", rows, cols, w, per_tensor=True)
        w16 = [max(-60000.0, min(60000.0, v)) if math.isfinite(v) else v for v in w]
        check(cli, tmp, "f16_rows", "<f2", rows, cols, w16)
        check(cli, tmp, "bf16_raw", None, rows, cols, w, raw=True)
        wb = [rnd.gauss(0, 0.05) for _ in range(200 * 150)]
        for c in range(128, 150):  # a far larger tile (0, 1)
            wb[5 * 150 + c] *= 100
        check_block(cli, tmp, 200, 150, wb)
        wg = [rnd.gauss(0, 0.05) for _ in range(2 * 200 * 150)]
        for c in range(150):  # the up half's first rows far larger than the gate's last
            wg[200 * 150 + c] *= 100
        check_gate_up(cli, tmp, 200, 150, wg)
        # Bad input: a missing file, a 1-D array, an int array, a raw size that does not match.
        write_npy(os.path.join(tmp, "one_d.npy"), "<f4", 1, 4, [1.0] * 4)
        data = open(os.path.join(tmp, "one_d.npy"), "rb").read().replace(b"(1, 4)", b"(4,)  ")
        open(os.path.join(tmp, "one_d.npy"), "wb").write(data)
        bad = [([os.path.join(tmp, "missing.npy")], "cannot open"),
               ([os.path.join(tmp, "one_d.npy")], "not 2-D"),
               ([os.path.join(tmp, "bf16_raw.bin"), "--raw-dtype", "bf16", "--raw-shape", "7,34"],
                "needs")]
        for args, text in bad:
            p = run(cli, *args, "--out", os.path.join(tmp, "x.npy"), "--scales",
                    os.path.join(tmp, "y.npy"), ok=False)
            if p.returncode != 1 or text not in p.stderr:
                sys.exit(f"FAIL: {args}: rc {p.returncode}, stderr {p.stderr!r} lacks {text!r}")
    print("fusedmlp quantize: f32/f16/bf16 inputs, per row, per tensor, per 128 x 128 block and "
          "per block of each gated half, NaN/Inf/zero rows, bad input: ok")


if __name__ == "__main__":
    main()

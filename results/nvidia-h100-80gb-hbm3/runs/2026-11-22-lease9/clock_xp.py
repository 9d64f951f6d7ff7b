"""(Exploratory; ran as xp/clock_xp.py from the repository root on the H100 and is kept beside its data. Its C
kernel `chain`, in xp/clockchain.c (not kept), is `clock_chain` of bench/host_resources.c: 16 dependent imuls.)
Experiment: is the host's slowness its clock? Chain of dependent imuls (48 cycles a round) -> effective GHz,
interleaved with the Python probe chunk (A) and with eager forwards (B)."""
import ctypes, json, os, subprocess, sys, time
HERE = os.path.dirname(os.path.abspath(__file__))
SO = "/tmp/clockchain.so"
if not os.path.exists(SO):
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", SO, f"{HERE}/clockchain.c"], check=True)
lib = ctypes.CDLL(SO); lib.chain.restype = ctypes.c_uint64; lib.chain.argtypes = [ctypes.c_uint64, ctypes.c_uint64]

def ghz(rounds):
    t = time.perf_counter_ns(); lib.chain(rounds, 3); return 48 * rounds / (time.perf_counter_ns() - t)

def work(n):
    acc = 0
    for i in range(n):
        acc = (acc + i * i) % 1000003
    return acc

def part_a(seconds):
    n = 20000
    out = []
    t0 = time.time()
    while time.time() - t0 < seconds:
        g1 = ghz(10000)  # ~0.15 ms
        t = time.perf_counter(); work(n); ms = (time.perf_counter() - t) * 1e3
        g2 = ghz(10000)
        out.append((time.time() - t0, ms, g1, g2))
    return out

def part_b(seconds, dtype, mode):
    import torch, torchvision
    torch.backends.cudnn.benchmark = True
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    m = torchvision.models.resnet50().eval().cuda().to(dt).to(memory_format=torch.channels_last)
    if mode == "compile":
        m = torch.compile(m)
    x = torch.randn(1, 3, 224, 224, device="cuda", dtype=dt).to(memory_format=torch.channels_last)
    out = []
    with torch.inference_mode():
        for _ in range(100):
            m(x)
        torch.cuda.synchronize()
        import gc; gc.collect(); gc.disable()
        t0 = time.time()
        while time.time() - t0 < seconds:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); h = time.thread_time(); m(x); h = time.thread_time() - h; b.record(); b.synchronize()
            g = ghz(1500)  # ~20 us
            out.append((time.time() - t0, a.elapsed_time(b), h * 1e3, g))
    return out

if __name__ == "__main__":
    what = sys.argv[1]
    if what == "a":
        res = part_a(float(sys.argv[2]))
    else:
        res = part_b(float(sys.argv[2]), sys.argv[3], sys.argv[4])
    json.dump(res, open(sys.argv[-1], "w"))

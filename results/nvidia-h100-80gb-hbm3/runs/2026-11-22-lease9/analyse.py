import json, sys, statistics as st
def q(v, f):
    v = sorted(v); return v[int(f * (len(v) - 1))]
def summ(name, v):
    return f"{name}: p10 {q(v,.1):.3f} med {q(v,.5):.3f} p90 {q(v,.9):.3f} p90/p10 {q(v,.9)/q(v,.1):.3f}"
for f in sys.argv[1:]:
    d = json.load(open(f))
    print(f, len(d))
    if len(d[0]) == 4 and 'a_' in f:
        ms = [r[1] for r in d]; g = [(r[2] + r[3]) / 2 for r in d]
        print(" ", summ("python chunk ms", ms)); print(" ", summ("GHz", g))
        print(" ", summ("chunk Mcycles", [m * x for m, x in zip(ms, g)]))
        print("   corr(ms, 1/GHz):", round(st.correlation(ms, [1 / x for x in g]), 3))
    else:
        lat = [r[1] for r in d]; host = [r[2] for r in d]; g = [r[3] for r in d]
        print(" ", summ("latency ms", lat)); print(" ", summ("host ms", host)); print(" ", summ("GHz", g))
        print(" ", summ("host Mcycles", [h * x for h, x in zip(host, g)]))
        print(" ", summ("latency Mcycles", [h * x for h, x in zip(lat, g)]))
        print("   corr(lat, 1/GHz):", round(st.correlation(lat, [1 / x for x in g]), 3))

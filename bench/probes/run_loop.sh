#!/usr/bin/env bash
# The loop probe, then ncu on one launch of each kernel with its stall reasons (one-off; see probe_sketch_loop.py).
set -u
CONTEXTS=131072,262144 MOSAIC_GPU_DUMP_PTXAS=1 python bench/probes/probe_sketch_loop.py > $OUT/log.txt 2> $OUT/err.txt
grep "Used\|failed" $OUT/log.txt | head
grep -v "^W0\|^I0\|ptxas\|bytes\|^$" $OUT/log.txt | tail -2 | cut -c1-1200
for k in v1 engine; do
  timeout 200 ncu --kernel-name regex:mosaic --launch-skip 2 --launch-count 1 --set full -o /tmp/$k python bench/probes/profile_sketch_kernel.py $k > /tmp/ncu_$k.log 2>&1
  ncu --import /tmp/$k.ncu-rep --page raw --csv > /tmp/raw_$k.csv 2>&1
  ncu --import /tmp/$k.ncu-rep --page details > $OUT/details_$k.txt 2>&1
  python3 - /tmp/raw_$k.csv <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head, units, vals = rows[0], rows[1], rows[2]
pick = [(h, v) for h, v in zip(head, vals) if ("pcsamp_warps_issue_stalled" in h and not h.endswith("not_issued"))
        or h in ("gpu__time_duration.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
                 "sm__inst_executed.sum", "smsp__issue_active.avg.pct_of_peak_sustained_active")]
pick.sort(key=lambda hv: -float(hv[1].replace(",", "")) if hv[1].replace(",", "").replace(".", "").isdigit() else 0)
print(sys.argv[1].split("/")[-1], [(h.replace("smsp__pcsamp_warps_issue_stalled_", ""), v) for h, v in pick[:16]])
PY
done

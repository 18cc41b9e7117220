#!/usr/bin/env bash
# ncu on one 256K launch of the Hopper sketch kernel: details, stall counters, and stall samples per SASS instruction.
set -u
ncu --clock-control none --kernel-name regex:mosaic --launch-skip 2 --launch-count 1 --set full --import-source yes \
    -o /tmp/sketch python bench/probes/profile_sketch_kernel.py > $OUT/ncu_run.log 2>&1
ncu --import /tmp/sketch.ncu-rep --page details > $OUT/details.txt 2>&1
ncu --import /tmp/sketch.ncu-rep --page raw --csv > $OUT/raw.csv 2>&1
ncu --import /tmp/sketch.ncu-rep --page source --csv --print-source sass > $OUT/sass.csv 2>$OUT/sass.err
ls -la $OUT; head -c 600 $OUT/sass.err

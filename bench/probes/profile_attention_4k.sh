#!/usr/bin/env bash
# ncu on one launch each of our Mosaic GPU attention kernel and cuDNN's at non-causal 4K GQA; first, every kernel each
# program launches (a name list), so the regexes match.
set -u
for who in ours cudnn; do
  ncu --clock-control none --launch-skip 0 --launch-count 20 --section LaunchStats python bench/probes/profile_attention_4k.py $who 2>&1 | grep -E '^\s+[A-Za-z_].*\(\d*|  [a-z_A-Z0-9]+.*Context' | head -20 > $OUT/kernels_$who.txt
done
ncu --clock-control none --kernel-name regex:mosaic --launch-skip 2 --launch-count 1 --set full -o /tmp/ours python bench/probes/profile_attention_4k.py ours > $OUT/ncu_ours.log 2>&1
ncu --clock-control none --kernel-name regex:'sdpa|flash|fmha|attn|cudnn' --launch-skip 2 --launch-count 1 --set full -o /tmp/cudnn python bench/probes/profile_attention_4k.py cudnn > $OUT/ncu_cudnn.log 2>&1
for who in ours cudnn; do
  ncu --import /tmp/$who.ncu-rep --page details > $OUT/details_$who.txt 2>&1
  ncu --import /tmp/$who.ncu-rep --page raw --csv > $OUT/raw_$who.csv 2>&1
done
ls -la $OUT; tail -3 $OUT/ncu_*.log; cat $OUT/kernels_*.txt | head -20

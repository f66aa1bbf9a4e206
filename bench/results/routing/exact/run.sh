#!/bin/bash
# W1 and mix (3 repetitions) and hot and W6 (one) at 70% of round robin's capacity on three simulators
# (bench/results/routing/capacity), six contenders, Inferrail in exact mode.
set -e
cd "$(dirname "$0")/../../../.."
b=target/release/inferrail-bench
sim="--block-size 16 --num-gpu-blocks-override 1100 --max-model-len 10240"
common=(--time-scale 0.1 --sim-flags "$sim" --think-s 1-2 --warmup-s 5 --kv-events --duration-s 25
        --contenders cost_model,round_robin,least_request,prefix_hash,kv_aware,sglang:cache_aware)
out=bench/results/routing/exact
$b compare "${common[@]}" --workloads w1 --reps 3 --rate 3.5 --out-dir $out/w1
$b compare "${common[@]}" --workloads mix --reps 3 --rate 3.85 --out-dir $out/mix
$b compare "${common[@]}" --workloads hot --reps 1 --rate 4.9 --out-dir $out/hot
$b compare "${common[@]}" --workloads w6 --reps 1 --rate 3.85 --out-dir $out/w6
$b report --routing $out/w1,$out/mix,$out/hot,$out/w6 --out-dir $out/report

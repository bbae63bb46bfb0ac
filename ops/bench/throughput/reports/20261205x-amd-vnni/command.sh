# Kernel A/B (each call builds every variant as its own library, ferry_dot_<name>; `--build` first under cpu-run):
/work/tools/cpu-run python ops/bench/throughput/vnni_ab.py --build old=87d6d4b final=WORK
/work/tools/cpu-bench python ops/bench/throughput/vnni_ab.py old=87d6d4b final=WORK --rounds 7 --out $R   # vnni_ab.json
python ops/bench/throughput/vnni_ab_plot.py $R/vnni_ab.json $R/vnni_ab.png
# The ideas, one call each (ab1..ab5 JSON; WORK = the working tree at that time, see the README section):
#  ab1: old new=WORK(region+chunk-major rows... +fold) new_r10=-DFERRY_DOT_MAX_ROWS=10 nofold=-DFERRY_DOT_FOLD_FROM_ROWS=99
#  ab2: old new(fold) bcast=-DFERRY_DOT_BCAST_ASM nofold nofold_bcast r10_bcast
#  ab3: old bytes=-DFERRY_DOT_NO_WORDS (= cf2269d) words words8 words10 (vpdpwssd, -DFERRY_DOT_WORDS_MAX_ROWS)
#  ab4: old new(= cf2269d) reduce=-DFERRY_DOT_QUANT_REDUCE pf4=-DFERRY_DOT_PREFETCH=4 pf12=-DFERRY_DOT_PREFETCH=12
#  ab5: old final(= 499e118) tile8=-DFERRY_DOT_TILE_BLOCKS=8 tile32=-DFERRY_DOT_TILE_BLOCKS=32
# Engine burst, before (git archive 87d6d4b in /tmp/vnni_base, its own extension build) vs this tree, alternating
# (engine_ab_5.txt, engine_ab_6.txt: two more ROUNDS=2 calls of 499e118; engine_ab.json: all runs, per-round ratios):
mkdir -p /tmp/vnni_base && git archive 87d6d4b | tar -x -C /tmp/vnni_base
ROUNDS=3 /work/tools/cpu-bench bash $R/engine_ab.sh     # engine_ab_1.txt (cf2269d), engine_ab_2.txt (499e118)
ROUNDS=2 /work/tools/cpu-bench bash $R/engine_ab.sh     # engine_ab_3.txt (499e118)
BASE=/tmp/vnni_mid ROUNDS=2 /work/tools/cpu-bench bash $R/engine_ab.sh   # engine_ab_4_prefetch.txt: cf2269d vs 499e118

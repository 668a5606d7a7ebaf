# one-off GPU run for the gated delta rule (helper script; not part of the package)
set -u
start=$(date +%s)
left() { echo $((260 - ($(date +%s) - start))); }
timeout 140 python -m pytest tests/gpu/test_gated_delta_rule.py -q -rA -p no:cacheprovider > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$?"; grep -E "passed|failed|error|FAILED|ERROR" "$OUT/pytest.txt" | tail -n 40
bench() {
  t=$(left); name=$1; shift
  if [ "$t" -gt 15 ]; then
    timeout "$t" python -m runtime.benchmark --operator gated_delta_rule --device cuda --no-peers --json "$OUT/$name.json" "$@" > "$OUT/$name.txt" 2>&1
    echo "== $name rc=$?"; grep -v -i warn "$OUT/$name.txt" | tail -n 12
  fi
}
bench pcvr --shape chunk-B256-T256-H4-D16 --backends torch,triton
bench b4 --shape chunk-B4-T4096-H16-D128 --backends torch,triton
bench rec-pcvr --shape recurrent-B256-T256-H4-D16 --mode fwd --backends triton
bench rec-b4 --shape recurrent-B4-T4096-H16-D128 --mode fwd --backends triton
bench packed --shape chunk-packed32768-H16-HV32-D128 --mode fwd --backends triton
echo "total $(( $(date +%s) - start )) s"

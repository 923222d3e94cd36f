#!/usr/bin/env bash
# Reproduce the defect table of issue 38: each seeded defect (Dnn-old.patch / Dnn-new.patch, made by
# make_patches.py, in $DEFECTS_OUT) applied to the suite before the reduction (a8f23b1, worktree $DEFECTS_OUT/wt-old)
# and after it (a6c7ade, $DEFECTS_OUT/wt-new), the four reduced test files plus the defect's most relevant file run with -x, and
# whether a test failed (caught) and which one first.
#
# usage: run.sh [ID ...]        (default: BASE then every defect; BASE = no defect, the union of the files)
#        TREES=old|new run.sh ...  (one tree)
#        PASS=reduced run.sh ... (only the nine test functions whose parametrization was reduced, -k; results go to
#                                 results-reduced-<tree>.tsv)
# Worktrees are created if missing (git worktree add --detach); nothing is committed. Run make_patches.py first.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
D=${DEFECTS_OUT:-/tmp/seeded-defects}   # patches (make_patches.py), logs, results
PY=${PY:-$REPO/.venv/bin/python}
mkdir -p $D
PASS=${PASS:-files}
FOUR="tests/test_gradients_16_bit.py tests/test_half_tables.py tests/test_output_dtype.py tests/test_gradient_check.py"
REDUCED="test_bit_identical_to_the_float32_copy or test_every_optimizer or test_copied_gradients or test_stacking_and_grouping or test_non_finite_is_refused_naming_the_feature_and_index or test_update_is_float32_math_then_the_rounding_rule or test_activations_are_the_float32_ones_cast or test_activations_streamed_past_the_caches_are_the_same or test_non_finite_gradient_is_refused_at_its_index_and_changes_nothing"
declare -A COMMIT=([old]=a8f23b1 [new]=a6c7ade)
mkdir -p $D/logs
TREES=${TREES:-old new}  # TREES=old or TREES=new: one tree (two runs, one per tree, may go side by side)

extra_of() { awk -F'\t' -v id="$1" '$1 == id {print $4}' $HERE/defects.tsv; }

ids=("$@")
if [ ${#ids[@]} -eq 0 ]; then ids=(BASE $(awk -F'\t' 'NR > 1 {print $1}' $HERE/defects.tsv)); fi

for t in $TREES; do
  [ -d $D/wt-$t ] || git -C $REPO worktree add --detach $D/wt-$t ${COMMIT[$t]}
done

for id in "${ids[@]}"; do
  for t in $TREES; do
    W=$D/wt-$t
    OUT=$D/results-$PASS-$t.tsv
    [ -f $OUT ] || printf 'id\ttree\tcaught\tfirst_failing\tsummary\tseconds\n' > $OUT
    if [ -n "$(git -C $W status --porcelain --untracked-files=no)" ]; then echo "$W is not clean" >&2; exit 1; fi
    if [ "$id" = BASE ]; then
      files="$FOUR $(awk -F'\t' 'NR > 1 {print $4}' $HERE/defects.tsv | sort -u | tr '\n' ' ')"
      patches=""
    else
      files="$FOUR $(extra_of $id)"
      patches=$D/$id-$t.patch
      git -C $W apply $patches || { echo "$id-$t does not apply" >&2; exit 1; }
      $PY $HERE/invalidate.py $W $patches > $D/logs/$id-$t-$PASS.invalidate
    fi
    [ "$PASS" = reduced ] && files="$FOUR"
    rm -rf $W/.hypothesis
    log=$D/logs/$id-$t-$PASS.log
    start=$(date +%s)
    if [ "$PASS" = reduced ]; then
      (cd $W && env PYTHONPATH=$W EMBEDCORE_CACHE_DIR=/tmp/defects-cache-$t EMBEDCORE_PROGRESS=0 \
         nice -n 15 $PY -m pytest -q -x -p no:cacheprovider --hypothesis-seed=0 -k "$REDUCED" $files) > $log 2>&1
    else
      (cd $W && env PYTHONPATH=$W EMBEDCORE_CACHE_DIR=/tmp/defects-cache-$t EMBEDCORE_PROGRESS=0 \
         nice -n 15 $PY -m pytest -q -x -p no:cacheprovider --hypothesis-seed=0 $files) > $log 2>&1
    fi
    rc=$?
    seconds=$(( $(date +%s) - start ))
    if [ -n "$patches" ]; then
      git -C $W checkout -- .
      $PY $HERE/invalidate.py $W $patches >> $D/logs/$id-$t-$PASS.invalidate
    fi
    rm -rf $W/.hypothesis
    first=$(grep -m1 -E '^(FAILED|ERROR) ' $log | sed -E 's/^(FAILED|ERROR) //; s/ - .*//')
    summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error)|^[0-9]+ (passed|failed)|(passed|failed|error).* in [0-9.]+s' $log | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')
    case $rc in
      0) caught=no ;;
      1) caught=yes ;;
      *) caught="rc=$rc" ;;
    esac
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$id" "$t" "$caught" "${first:--}" "$summary" "$seconds" >> $OUT
    echo "$id $t caught=$caught first=${first:--} ($summary, ${seconds}s)"
  done
done

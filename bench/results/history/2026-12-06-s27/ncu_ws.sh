#!/bin/bash
# v36 union-scored kernel at 4096x32K: LSU pipe, tensor pipe, local memory, stalls
S=smsp__average_warps_issue_stalled
M=l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts.sum,sm__cycles_elapsed.avg,gpu__time_duration.sum
M=$M,smsp__inst_executed_op_ldsm.sum,smsp__inst_executed_op_ldgsts.sum,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_shared_st.sum,smsp__inst_executed_op_local_ld.sum,smsp__inst_executed_op_local_st.sum,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active
M=$M,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active
for r in long_scoreboard short_scoreboard wait mio_throttle lg_throttle math_pipe_throttle barrier sleeping branch_resolving no_instruction selected membar misc; do
  M=$M,${S}_${r}_per_issue_active.ratio
done
timeout 200 ncu --metrics $M -k regex:grouped_attn --launch-skip 2 --launch-count 1 \
  python3 bench/attention_probe.py --cases 4096x32K --iters 1 --reruns 0 --check 2 "$@"

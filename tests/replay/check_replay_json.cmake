# Runs mkv-replay on tiny_mooncake.jsonl and checks its --json figures against values computed by
# hand (blocks of 512 tokens, pages of 128): request 1 [1, 2] reuses 0; 2 [1, 2, 3] reuses 1024;
# 3 [1, 9] reuses 512; 4 repeats 1 and, fully matched and page-aligned, recomputes its last
# page: 896. Prompt tokens 1024 + 1500 + 700 + 1024 = 4248, reused 2432.
# With -DSPECULATIVE=eagle (an EAGLE draft, every position checked): every paired path's last
# page is replayed, so request 2 reuses 896, request 3 384 and request 4 896 (its last page is
# recomputed anyway): 2176 reused, base and draft, 3 last-page replays, 10 generated tokens.
# With -DHYBRID=ON the same trace replays a hybrid model (--recurrent-layers 2: exact checkpoints):
# request 2 restores request 1's 1024-token prompt checkpoint; requests 3 ([1, 9]) and 4 (request
# 1 again: no checkpoint strictly shorter than its prompt) reuse nothing: 1024 reused against the
# attention-only 2432, one restore, 0 recurrent mismatches.
# With -DBUDGET=ON the vanilla replay runs on --kv-budget-bytes 65636: 16 pages of 4 KiB (100 bytes
# left over) hold the whole trace, so the figures are the same, and the JSON lists the one pool.
# Usage: cmake -DMKV_REPLAY=<exe> -DTRACE=<jsonl> -DOUT=<json>
#        [-DSPECULATIVE=eagle | -DHYBRID=ON | -DBUDGET=ON] -P check_replay_json.cmake
# Runs mkv-replay with the arguments given and reads its --json output into `json`.
function(run_replay)
  execute_process(COMMAND ${MKV_REPLAY} --trace ${TRACE} --json ${OUT} --quiet ${ARGN}
                  RESULT_VARIABLE rc ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "mkv-replay exited with ${rc}: ${err}")
  endif()
  file(READ ${OUT} contents)
  set(json "${contents}" PARENT_SCOPE)
endfunction()

# Each argument is key=value, the key a dotted path into `json` (hybrid.checkpoints_restored).
function(expect_json)
  foreach(expectation ${ARGN})
    string(REPLACE "=" ";" pair ${expectation})
    list(GET pair 0 key)
    list(GET pair 1 expected)
    string(REPLACE "." ";" path ${key})
    string(JSON value GET "${json}" ${path})
    if(NOT value EQUAL expected)
      message(FATAL_ERROR "${key} is ${value}, expected ${expected}\n${json}")
    endif()
  endforeach()
endfunction()

if(HYBRID)
  run_replay(--recurrent-layers 2)
  expect_json(reused_tokens=1024 prompt_tokens=4248 oracle_mismatches=0 recurrent_layers=2
              hybrid.checkpoints_restored=1 hybrid.checkpoints_published=6
              hybrid.snapshot_pressure_skips=0 hybrid.recurrent_mismatches=0
              hybrid.recurrent_snapshot_slots=10 hybrid.attention_only_reused_tokens=2432)
  string(JSON checks GET "${json}" hybrid recurrent_checks)
  if(NOT checks GREATER 0)
    message(FATAL_ERROR "hybrid.recurrent_checks is ${checks}, expected > 0")
  endif()
  return()
endif()
if(DEFINED SPECULATIVE)
  run_replay(--speculative ${SPECULATIVE} --verify all)
  expect_json(reused_tokens=2176 prefill_tokens_computed=2072
              speculative.draft_reused_tokens=2176 speculative.draft_reused_pages=17
              speculative.full_page_replays=3 speculative.draft_oracle_mismatches=0
              speculative.base_oracle_mismatches=0)
  set(expected_hit 0.512241)
  string(JSON checks GET "${json}" speculative draft_oracle_checks)
  if(checks LESS_EQUAL 2176)
    message(FATAL_ERROR "speculative.draft_oracle_checks is ${checks}: the reused draft rows "
                        "and more must be checked")
  endif()
elseif(BUDGET)
  run_replay(--kv-budget-bytes 65636)
  expect_json(reused_tokens=2432 prefill_tokens_computed=1816 decode_steps=6
              kv_budget_bytes=65636 pool_pages=16 kv_bytes=65536 pools.0.pages=16
              pools.0.bytes_per_page=4096 pools.0.bytes=65536)
  string(JSON pools LENGTH "${json}" pools)
  string(JSON name GET "${json}" pools 0 name)
  string(JSON peak GET "${json}" pools 0 peak_pages_in_use)
  string(JSON peak_kv GET "${json}" peak_kv_bytes)
  math(EXPR expected_peak_kv "${peak} * 4096")
  if(NOT pools EQUAL 1 OR NOT name STREQUAL "full" OR NOT peak_kv EQUAL expected_peak_kv)
    message(FATAL_ERROR "pools: ${pools} (${name}), peak_kv_bytes ${peak_kv}, expected "
                        "${expected_peak_kv}\n${json}")
  endif()
  set(expected_hit 0.572504)
else()
  run_replay()
  expect_json(reused_tokens=2432 prefill_tokens_computed=1816 decode_steps=6)
  set(expected_hit 0.572504)
endif()
expect_json(requests=4 prompt_tokens=4248 generated_tokens=10 evicted_records=0 failed_requests=0
            joins=0 oracle_mismatches=0 page_size=128 misses_by_reason.no_prefix=3)
string(JSON swa_type TYPE "${json}" swa_pages_per_sequence)
if(NOT swa_type STREQUAL "NULL")
  message(FATAL_ERROR "swa_pages_per_sequence is ${swa_type}, expected null outside bounded SWA")
endif()
string(JSON hit GET "${json}" hit_rate)
string(SUBSTRING "${hit}" 0 8 hit)
if(NOT hit STREQUAL expected_hit)
  message(FATAL_ERROR "hit_rate is ${hit}, expected ${expected_hit}...")
endif()
string(JSON mode GET "${json}" mode)
string(JSON backend GET "${json}" backend)
if(NOT mode STREQUAL "reuse" OR NOT backend STREQUAL "context-reuse")
  message(FATAL_ERROR "mode ${mode}, backend ${backend}")
endif()

# Python's round() rounds half to even, and the module must too: 5 tokens/day of 1 input and
# 1 output token per request is 2.5 input tokens (kvfabric plan: 2, not 3), and 2 at a 25%
# hit rate is 0.5 hit tokens (kvfabric plan: 0, not 1).

run "rounds_half_to_even" {
  command = plan
  variables {
    tokens_per_day            = 5
    input_tokens_per_request  = 1
    output_tokens_per_request = 1
    hit_rate                  = 0.25
  }
  assert {
    condition = (
      output.traffic.input_tokens_per_day == 2 && output.traffic.output_tokens_per_day == 3
      && output.traffic.hit_tokens_per_day == 0 && output.traffic.miss_tokens_per_day == 2
    )
    error_message = "Ties must round half to even, as Python's round() does."
  }
}

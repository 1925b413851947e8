"""hlo_kernels: the kernels of an optimized HLO module, their bytes and classes."""

from experiments.shared.hlo_kernels import by_kind, kernels, shape_bytes

# HLO lines are long: the module is as XLA prints it.
MODULE = """\
HloModule step

%fused_reduce (param_0: f32[64,32]) -> f32[64] {
  %param_0 = f32[64,32]{1,0} parameter(0)
  %exponential = f32[64,32]{1,0} exponential(%param_0)
  %constant = f32[] constant(0)
  ROOT %reduce = f32[64]{0} reduce(%exponential, %constant), dimensions={1}, to_apply=%add
}

%fused_update (param_0.1: f32[1024,32], param_1: f32[1,32], param_2: s32[]) -> f32[1024,32] {
  %param_0.1 = f32[1024,32]{1,0} parameter(0)
  %param_1 = f32[1,32]{1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  ROOT %dynamic-update-slice = f32[1024,32]{1,0} dynamic-update-slice(%param_0.1, %param_1, %param_2, %zero)
}

%body (state: (s32[], f32[1024,32], f32[1,32])) -> (s32[], f32[1024,32], f32[1,32]) {
  %state = (s32[], f32[1024,32]{1,0}, f32[1,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %buffer = f32[1024,32]{1,0} get-tuple-element(%state), index=1
  %row = f32[1,32]{1,0} get-tuple-element(%state), index=2
  %put = f32[1024,32]{1,0} fusion(%buffer, %row, %i), kind=kLoop, calls=%fused_update
  ROOT %next = (s32[], f32[1024,32]{1,0}, f32[1,32]{1,0}) tuple(%i, %put, %row)
}

ENTRY %main (x: f32[64,32], w: bf16[32,16], init: (s32[], f32[1024,32], f32[1,32])) -> f32[64] {
  %x = f32[64,32]{1,0} parameter(0)
  %w = bf16[32,16]{1,0} parameter(1)
  %init = (s32[], f32[1024,32]{1,0}, f32[1,32]{1,0}) parameter(2)
  %gemm = bf16[64,16]{1,0} custom-call(%x, %w), custom_call_target="__cublas$gemm"
  %loop = (s32[], f32[1024,32]{1,0}, f32[1,32]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %sums = f32[64]{0} fusion(%x), kind=kInput, calls=%fused_reduce
}
"""  # noqa: E501


def test_shapes_and_tuples_in_bytes():
    assert shape_bytes("f32[64,32]{1,0}") == 64 * 32 * 4
    assert shape_bytes("(bf16[2,3]{1,0}, /*index=1*/s32[], pred[8])") == 12 + 4 + 8
    assert shape_bytes("token[]") == 0


def test_each_kernel_with_its_bytes_class_and_trips():
    found = {kernel.name: kernel for kernel in kernels(MODULE)}
    assert set(found) == {"gemm", "put", "sums"}
    assert found["gemm"].kind == "matmul"
    assert found["gemm"].bytes == 64 * 32 * 4 + 32 * 16 * 2 + 64 * 16 * 2
    assert found["sums"].kind == "reduction"
    assert found["sums"].bytes == 64 * 32 * 4 + 64 * 4
    # In place: the row read and written, the buffer untouched otherwise; four trips.
    assert found["put"].kind == "elementwise"
    assert found["put"].launches == 4
    assert found["put"].bytes == 4 * (2 * 32 * 4 + 4)
    assert by_kind(list(found.values()))["matmul"]["kernels"] == 1

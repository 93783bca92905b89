"""benchmarks/harness/kernel_compile.py: its reading of PTX, and a kernel compiled for sm_90 without a GPU (the conv
kernels' own compile check is in tests/test_causal_conv.py)."""
from benchmarks.harness.kernel_compile import compile_for_gpu, count_accesses, main


def test_accesses_are_counted_by_their_vector_width_first():
    ptx = """
        ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
        @%p1 ld.global.L1::evict_last.v2.b32 { %r5, %r6 }, [ %rd2 + 0 ];
        ld.global.b16 { %rs1 }, [ %rd3 + 0 ];
        @%p2 st.global.b32 [ %rd4 + 0 ], { %r7 };
        st.global.v4.b32 [ %rd5 + 0 ], { %r1, %r2, %r3, %r4 };
        ld.shared.v4.b32 { %r1, %r2, %r3, %r4 }, [ %r9 + 0 ];
    """
    counts = count_accesses(ptx)
    assert counts == {"ld_v4": 1, "ld_v2": 1, "ld_b32": 0, "ld_b16": 1, "st_v4": 1, "st_v2": 0, "st_b32": 1,
                      "st_b16": 0}  # the shared-memory load is not a global one


def test_a_copy_kernel_compiles_with_vector_accesses_and_the_cli_prints_json_lines(capsys):
    import triton
    import triton.language as tl

    @triton.jit
    def copy(x, y, n, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y + o, tl.load(x + o, mask=o < n), mask=o < n)

    row = compile_for_gpu(copy, {"x": "*bf16", "y": "*bf16"}, {"BLOCK": 1024}, num_warps=4)
    assert row["stack_bytes"] == 0 and 0 < row["registers"] < 64
    assert row["ld_v4"] > 0 and row["st_v4"] > 0 and row["ld_b16"] == row["st_b16"] == 0  # 8 elements a thread
    rows = main(["--kernels", "conv"])
    # one, three and three normalised outputs: (4 + 5 x 2 + 7 with X_ONCE) x 2 + (2 + 2 x 2 + 2) configurations
    assert len(rows) == len(capsys.readouterr().out.splitlines()) == 50

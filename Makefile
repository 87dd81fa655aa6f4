# flatmoe — build, train, test, bench.
#   make train              install what is missing, build, prepare the default data, train (needs a GPU)
#   make test               install what is missing, build the tests (both precisions) and what they drive, run them all
#   make all                every binary: the tests, both trainers, the benchmarks, the toy (CI builds it first)
#   make bench              training speed (default model and config B1 under three routings: tokens/s, MFU,
#                           memory, expert balance, per-operator breakdown) and reach (the longest context and
#                           largest batch of three MoE models: plain, recomputed, --plan auto; needs a GPU);
#                           BENCH_PARTS="speed" or "reach" for one,
#                           "multi" for the default model on every GPU against one (2 GPUs or more)
#   make toy                print one toy MoE layer traced through expert parallelism, forward, backward and
#                           bytes, the ring operators' toys and Ulysses' all-to-all (CPU: g++ and Eigen, no nvcc);
#                           TOY=ep|pllep|relay|ring_dtp|ulysses: one
#   make data [CORPUS=large] prepare the corpus: fortunes (default) or large (fortunes + GCIDE)
# Variables: PRECISION=BF16|FP32 (for train/bench), GPU_ARCH=90a, EIGEN_DIR, GTEST_DIR, NVCC,
#   CORPUS=fortunes|large, FORTUNES (folder), GCIDE (gcide.dict.dz), DATA_DIR, BENCH_PARTS, TOY.

PRECISION ?= BF16
GPU_ARCH  ?= 90a
NVCC      ?= nvcc
CXX       ?= g++
EIGEN_DIR ?= /usr/include/eigen3
GTEST_DIR ?= /usr/src/googletest/googletest
FORTUNES  ?= /usr/share/games/fortunes
CORPUS    ?= fortunes
# The GNU Collaborative International Dictionary of English, Debian's dict-gcide; when GCIDE is left
# as it is, the package is downloaded and unpacked into .deps/ (not installed: it would pull dictd).
GCIDE_DEFAULT := .deps/usr/share/dictd/gcide.dict.dz
GCIDE     ?= $(GCIDE_DEFAULT)
ifeq ($(CORPUS),fortunes)
DATA_DIR  ?= data/fortunes
CORPUS_FILES :=
PREPARE_FLAGS := --input $(FORTUNES)
else ifeq ($(CORPUS),large)
DATA_DIR  ?= data/large
CORPUS_FILES := $(GCIDE)
# --val-frac 0.12: the validation shard holds 12 batches of 16 x 1024 tokens per rank at 8 ranks (README)
PREPARE_FLAGS := --input $(FORTUNES) --input $(GCIDE) --val-frac 0.12
else
$(error CORPUS must be fortunes or large, got '$(CORPUS)')
endif
TRAIN_FLAGS ?=
BENCH_PARTS ?= speed reach

BUILD := build
# every core unless the command line says -jN: a fresh `make test` compiles ~60 CUDA files
ifeq (,$(filter -j%,$(MAKEFLAGS)))
MAKEFLAGS += -j$(shell nproc)
endif
CXXFLAGS := -std=c++17 -O2 -Wall -Wextra -I. -isystem $(EIGEN_DIR) -MMD -MP
# EIGEN_NO_CUDA: Eigen is the tests' host-side reference, never device code; without it, Eigen marks its
# functions __host__ __device__ and nvcc warns about those marks in Eigen's headers (#20012, ~18 per file).
# the real architecture only (sm_90a code does not run on other GPUs, and has no portable PTX form)
ARCH_FLAGS := -gencode arch=compute_$(GPU_ARCH),code=sm_$(GPU_ARCH)
NVFLAGS  := -std=c++17 -O3 $(ARCH_FLAGS) -lineinfo -I. -isystem $(EIGEN_DIR) -DEIGEN_NO_CUDA -MMD -MP \
            -Xcompiler -Wall --expt-relaxed-constexpr $(if $(filter 90a,$(GPU_ARCH)),-DFLATMOE_WGMMA)
# FLATMOE_WGMMA: Hopper's warpgroup MMA (sm_90a only) for the expert GEMMs (ops/grouped_gemm.cuh) and
# attention at head dim 64 (ops/attention_mma.cuh); other GPU_ARCH values (80 for A100, 90 without it)
# build the same kernels' mma.sync form.
GTEST_INC := -isystem $(GTEST_DIR)/include -isystem $(GTEST_DIR)
CUDA_LIBS := -lcublas -lcublasLt -lnccl -lcudart

# precision lower-case: fp32 | bf16
prec = $(if $(filter BF16,$(1)),bf16,$(if $(filter FP32,$(1)),fp32,$(error PRECISION must be BF16 or FP32, got '$(1)')))
P := $(call prec,$(PRECISION))

CPU_TESTS := $(wildcard tests/cpu_*.cpp)
# tests/cpu_*.cu need no GPU but nvcc: they test an operator's host-side plan, which lives beside its kernels
# in ops/NAME.cuh; test_gpu holds them, and they run on every machine
GPU_TESTS := $(wildcard tests/gpu_*.cu tests/cpu_*.cu)
DIST_TESTS := $(wildcard tests/dist_*.cu)
# Test files compiled together, as one translation unit per precision (build/unity/NAME.cu includes
# them), so that the headers and kernels they share compile once, not once per file: the GPU tests that
# build the whole model (model.cuh), the other GPU tests, and the multi-rank tests. The files of a group
# share one scope: each names its helpers for itself.
GPU_MODEL_TESTS := $(addprefix tests/,gpu_adamw.cu gpu_memory_prediction.cu gpu_model.cu gpu_moe.cu gpu_profile.cu \
                                      gpu_router.cu gpu_sco.cu gpu_zero3.cu)
GPU_OP_TESTS := $(filter-out $(GPU_MODEL_TESTS),$(GPU_TESTS))
# written at parse time, and only when its list changes (so that its object is not rebuilt for nothing)
unity_source = $(shell mkdir -p $(BUILD)/unity && printf '\043include "%s"\n' $(2) > $(BUILD)/unity/$(1).new && \
                 { cmp -s $(BUILD)/unity/$(1).new $(BUILD)/unity/$(1) || mv $(BUILD)/unity/$(1).new $(BUILD)/unity/$(1); } && \
                 rm -f $(BUILD)/unity/$(1).new)
$(call unity_source,gpu_model_tests.cu,$(GPU_MODEL_TESTS))
$(call unity_source,gpu_op_tests.cu,$(GPU_OP_TESTS))
$(call unity_source,dist_tests.cu,$(DIST_TESTS))
BENCHES := $(patsubst tools/%.cu,%,$(wildcard tools/bench_*.cu))

.PHONY: all deps cpu-deps data train test bench toy clean
# what `make test` runs: the test binaries and the tools the CPU tests drive (prepare, synthetic_tokens, the
# FP32 trainer); `all` adds the BF16 trainer, the benchmarks and the toy
TEST_BINS := $(BUILD)/prepare $(BUILD)/synthetic_tokens $(BUILD)/test_cpu $(BUILD)/fp32/train \
             $(foreach p,fp32 bf16,$(BUILD)/$(p)/test_gpu $(BUILD)/$(p)/test_dist)
all: $(TEST_BINS) $(BUILD)/toy_trace $(BUILD)/bench_cpu_adamw $(BUILD)/bf16/train $(foreach p,fp32 bf16,$(addprefix $(BUILD)/$(p)/,$(BENCHES)))

# ---- dependencies (Debian packages), installed only when missing --------------------------
DEB_PKGS :=
ifeq ($(wildcard $(EIGEN_DIR)/Eigen/Dense),)
DEB_PKGS += libeigen3-dev
endif
ifeq ($(wildcard $(GTEST_DIR)/src/gtest-all.cc),)
DEB_PKGS += googletest
endif
ifeq ($(wildcard $(FORTUNES)/fortunes),)
DEB_PKGS += fortunes
endif
# optional: only the memory timeline plots need it
ifeq ($(shell command -v gnuplot),)
OPT_PKGS := gnuplot-nox
endif
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

# cpu-deps: what the CPU-only targets (test_cpu, toy_trace, prepare, ...) need: g++ and the packages
# above. deps: the GPU targets' (train, test, bench), the CUDA Toolkit and the plots' gnuplot too.
cpu-deps:
ifneq ($(strip $(DEB_PKGS)),)
	@echo "installing Debian packages: $(DEB_PKGS)"
	$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $(DEB_PKGS)
endif

deps: cpu-deps
ifneq ($(strip $(OPT_PKGS)),)
	-@DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $(OPT_PKGS) > /dev/null 2>&1 || \
	  echo "note: could not install $(OPT_PKGS): memory timeline plots will be skipped"
endif
	@command -v $(NVCC) > /dev/null || { echo "error: $(NVCC) not found: install the CUDA Toolkit (nvcc, cuBLAS, NCCL)"; exit 1; }

# ---- GoogleTest from source (the Debian package ships it as source) -----------------------
$(BUILD)/gtest/gtest-all.o: | cpu-deps
	@mkdir -p $(@D)
	$(CXX) -std=c++17 -O2 $(GTEST_INC) -c $(GTEST_DIR)/src/gtest-all.cc -o $@
$(BUILD)/gtest/gtest_main.o: | cpu-deps
	@mkdir -p $(@D)
	$(CXX) -std=c++17 -O2 $(GTEST_INC) -c $(GTEST_DIR)/src/gtest_main.cc -o $@
GTEST_OBJS := $(BUILD)/gtest/gtest-all.o $(BUILD)/gtest/gtest_main.o

# ---- CPU: data tool and CPU tests ----------------------------------------------------------
$(BUILD)/prepare: data/prepare.cpp | cpu-deps
	@mkdir -p $(@D)
	$(CXX) $(CXXFLAGS) $< -o $@

$(BUILD)/synthetic_tokens: tools/synthetic_tokens.cpp | cpu-deps
	@mkdir -p $(@D)
	$(CXX) $(CXXFLAGS) $< -o $@

$(BUILD)/toy_trace: tools/toy_trace.cpp | cpu-deps
	@mkdir -p $(@D)
	$(CXX) $(CXXFLAGS) $< -o $@

# --optimizer cpu_adamw's loop (ops/cpu_adamw.hpp says why these flags); linked into every binary.
# make build/cpu_adamw.vec: the compiler's vectorisation report and the packed instructions in the object.
CPU_ADAMW_FLAGS := -O3 -march=native -fno-math-errno -ffp-contract=off
CPU_ADAMW := $(BUILD)/cpu_adamw.o
$(CPU_ADAMW): ops/cpu_adamw.cpp | cpu-deps
	@mkdir -p $(@D)
	$(CXX) $(CXXFLAGS) $(CPU_ADAMW_FLAGS) -c $< -o $@
$(BUILD)/cpu_adamw.vec: ops/cpu_adamw.cpp $(CPU_ADAMW)
	$(CXX) $(filter-out -MMD -MP,$(CXXFLAGS)) $(CPU_ADAMW_FLAGS) -fopt-info-vec-optimized -c $< -o /dev/null 2> $@.tmp
	grep 'cpu_adamw.cpp' $@.tmp > $@; rm -f $@.tmp
	objdump -d --no-show-raw-insn $(CPU_ADAMW) | grep -oE 'v(fmadd|fnmadd)[0-9]+ps|vdivps|vsqrtps' | sort | uniq -c >> $@
	cat $@

# the CPU AdamW loop alone (no GPU): scalar vs vectorised, 1 thread to all
$(BUILD)/bench_cpu_adamw: tools/bench_cpu_adamw.cpp $(CPU_ADAMW) | cpu-deps
	$(CXX) $(CXXFLAGS) $< $(CPU_ADAMW) -pthread -o $@

$(BUILD)/cpu/%.o: tests/%.cpp | cpu-deps
	@mkdir -p $(@D)
	$(CXX) $(CXXFLAGS) $(GTEST_INC) -c $< -o $@

$(BUILD)/test_cpu: $(patsubst tests/%.cpp,$(BUILD)/cpu/%.o,$(CPU_TESTS)) $(CPU_ADAMW) $(GTEST_OBJS)
	$(CXX) $^ -pthread -o $@

# ---- GPU: trainer and GPU tests, one build per precision -----------------------------------
define precision_build
$(BUILD)/$(1)/train: train.cu $(CPU_ADAMW) | deps
	@mkdir -p $$(@D)
	$(NVCC) $(NVFLAGS) $(2) $$< $(CPU_ADAMW) $(CUDA_LIBS) -o $$@

# a test group's object; a test file's alone (make build/fp32/gpu_rope.o) is a quicker compile check
$(BUILD)/$(1)/%.o: $(BUILD)/unity/%.cu | deps
	@mkdir -p $$(@D)
	$(NVCC) $(NVFLAGS) $(2) $(GTEST_INC) -c $$< -o $$@

$(BUILD)/$(1)/%.o: tests/%.cu | deps
	@mkdir -p $$(@D)
	$(NVCC) $(NVFLAGS) $(2) $(GTEST_INC) -c $$< -o $$@

$(BUILD)/$(1)/test_gpu: $(BUILD)/$(1)/gpu_model_tests.o $(BUILD)/$(1)/gpu_op_tests.o $(CPU_ADAMW) $(GTEST_OBJS)
	$(NVCC) $(ARCH_FLAGS) $$^ $(CUDA_LIBS) -Xcompiler -pthread -o $$@

# multi-rank tests: dist_main.cu is their main (it starts the ranks), so no gtest_main
$(BUILD)/$(1)/test_dist: $(BUILD)/$(1)/dist_tests.o $(CPU_ADAMW) $(BUILD)/gtest/gtest-all.o
	$(NVCC) $(ARCH_FLAGS) $$^ $(CUDA_LIBS) -Xcompiler -pthread -o $$@

$(BUILD)/$(1)/bench_%: tools/bench_%.cu $(CPU_ADAMW) | deps
	@mkdir -p $$(@D)
	$(NVCC) $(NVFLAGS) $(2) $$< $(CPU_ADAMW) $(CUDA_LIBS) -o $$@
endef
$(eval $(call precision_build,fp32,))
$(eval $(call precision_build,bf16,-DFLATMOE_BF16))

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)

# ---- data ----------------------------------------------------------------------------------
$(DATA_DIR)/train_000.bin: $(BUILD)/prepare $(CORPUS_FILES)
	$(BUILD)/prepare $(PREPARE_FLAGS) --out $(DATA_DIR)
data: $(DATA_DIR)/train_000.bin

# dict-gcide's .deb fetched with apt-get download (after an apt-get update if the lists lack it) and
# unpacked with dpkg -x, only when the file is missing
$(GCIDE_DEFAULT):
	@mkdir -p .deps/debs
	cd .deps/debs && { apt-get download dict-gcide || { $(SUDO) apt-get update -qq && apt-get download dict-gcide; }; }
	dpkg -x "$$(ls -t .deps/debs/dict-gcide_*.deb | head -n 1)" .deps
	@test -f $@ || { echo "error: the dict-gcide package holds no $@"; exit 1; }
ifneq ($(GCIDE),$(GCIDE_DEFAULT))
$(GCIDE):
	@echo "error: GCIDE=$@ does not exist (gcide.dict.dz of Debian's dict-gcide; leave GCIDE unset to fetch it into .deps/)"; exit 1
endif

# ---- the two commands of the README --------------------------------------------------------
train: deps $(BUILD)/$(P)/train data
	$(BUILD)/$(P)/train --data $(DATA_DIR) $(TRAIN_FLAGS)

test: deps $(TEST_BINS) data
	FLATMOE_BIN=$(BUILD)/ FLATMOE_TRAIN=$(BUILD)/fp32/train tests/run_tests.sh $(BUILD)/test_cpu $(foreach p,fp32 bf16,$(BUILD)/$(p)/test_gpu $(BUILD)/$(p)/test_dist)

# one toy MoE layer traced through expert parallelism on the CPU, then the ring operators' toys and
# Ulysses' all-to-all (tools/toy_trace.hpp); TOY= one of them
TOY ?=
toy: $(BUILD)/toy_trace
	$(BUILD)/toy_trace $(TOY)

bench: deps $(BUILD)/$(P)/train $(BUILD)/synthetic_tokens data
	tools/bench_train.sh $(BUILD)/$(P)/train $(DATA_DIR) $(BUILD)/bench "$(BENCH_PARTS)"

clean:
	rm -rf $(BUILD)

# Two entry points on a fresh Debian 12 machine: `make demo` and `make test`.
# Both install what is missing (scripts/install-deps.sh), then build with CMake + Ninja.
BUILD      ?= build
BUILD_ASAN ?= build-asan
JOBS       ?= $(shell nproc)
MODEL      ?= models/kvq-code-tiny
SHARED     ?= ../shared

.PHONY: all deps build test demo sanitize-test fuzz clean format

all: build

deps:
	@bash scripts/install-deps.sh

$(BUILD)/build.ninja: | deps
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release

build: deps $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS)

test: build
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS)

# The sanitizer build (AddressSanitizer + UndefinedBehaviorSanitizer), CPU only.
sanitize-test: deps
	cmake -S . -B $(BUILD_ASAN) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVQ_SANITIZE=ON \
	  -DKVQ_CUDA=OFF -DKVQ_BUILD_BENCH=OFF
	cmake --build $(BUILD_ASAN) -j $(JOBS)
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  ctest --test-dir $(BUILD_ASAN) --output-on-failure -j $(JOBS)

# libFuzzer over every untrusted-input parser (clang; build-fuzz/), FUZZ_SECONDS per target.
FUZZ_SECONDS ?= 60
fuzz: deps
	bash scripts/fuzz.sh $(FUZZ_SECONDS)

demo: build
	@bash scripts/demo.sh $(BUILD)/kvq $(MODEL) $(SHARED)

format:
	clang-format -i $$(git ls-files '*.h' '*.cc' '*.cu' '*.cuh')

clean:
	rm -rf $(BUILD) $(BUILD_ASAN) build-fuzz

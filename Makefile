# Thin wrapper over CMake: `make run` and `make test` install what is missing, build, then run the
# daemon or every test. BUILD and CMAKE_ARGS may be overridden: make test CMAKE_ARGS=-DRNND_WERROR=ON
# Quiet by default: a build prints the targets it (re)built, warnings and errors, and a test run
# ctest's progress and failures; `make V=1 ...` prints every command and each test's output.
BUILD ?= build
CMAKE_ARGS ?=
JOBS ?= $(shell nproc)
V ?= 0
SHELL := /bin/bash

# The build's own make must not inherit this one's flags and level: that is what made it print
# "Entering/Leaving directory" around every step.
BUILD_CMD = env -u MAKEFLAGS -u MAKELEVEL -u MFLAGS cmake --build $(BUILD) -j $(JOBS)
ifeq ($(V),1)
BUILD_CMD += --verbose
CTEST_FLAGS = --output-on-failure -V
else
# Percent lines are CMake's per-file progress: hidden, and a target is named once it is built,
# only if something in it was. Everything else (warnings, errors, make's *** lines) stays.
BUILD_CMD += | awk '/^\[ *[0-9]+%\] Built target / { if (work) print; work = 0; fflush(); next } \
                    /^\[ *[0-9]+%\] / { work = 1; next } { print; fflush() }'
CTEST_FLAGS = --output-on-failure --progress
endif

.PHONY: all deps build run test format format-check clean

all: build

deps:
	@bash deploy/install-deps.sh

build: deps
	@if [ ! -f $(BUILD)/CMakeCache.txt ]; then \
	  echo "make: first build into $(BUILD)/: under a minute on 2 idle cores for the CPU" \
	       "backend (the CUDA kernels, built when nvcc is found, take longer);" \
	       "make V=1 prints every command"; \
	fi
	@cmake -S . -B $(BUILD) $(CMAKE_ARGS) >/dev/null
	@set -o pipefail; $(BUILD_CMD)

run: build
	$(BUILD)/server/rnnd --config deploy/rnnd.conf

test: build
	@cd $(BUILD) && ctest $(CTEST_FLAGS) -j $(JOBS)

# The C and CUDA sources, laid out by .clang-format (clang-format 14); .ci/run checks them.
FORMAT_FILES = git ls-files '*.c' '*.h' '*.cu' '*.cuh'
format:
	@$(FORMAT_FILES) | xargs clang-format -i

format-check:
	@$(FORMAT_FILES) | xargs clang-format --dry-run --Werror

clean:
	rm -rf $(BUILD)

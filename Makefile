# Thin wrapper over CMake: `make run` and `make test` install what is missing, build, then run the
# daemon or every test. BUILD and CMAKE_ARGS may be overridden: make test CMAKE_ARGS=-DRNND_WERROR=ON
BUILD ?= build
CMAKE_ARGS ?=
JOBS ?= $(shell nproc)

.PHONY: all deps build run test clean

all: build

deps:
	@bash deploy/install-deps.sh

build: deps
	@cmake -S . -B $(BUILD) $(CMAKE_ARGS) >/dev/null
	@cmake --build $(BUILD) -j $(JOBS)

run: build
	$(BUILD)/server/rnnd --config deploy/rnnd.conf

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

clean:
	rm -rf $(BUILD)

// The part of torch the kernels use: tensors, the factories they call and pybind11's casters for them.
// torch/extension.h would bring the whole C++ frontend too (autograd, nn, optimizers): most of a file's compile time.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <torch/csrc/utils/pybind.h>

// The object library tandem_pch compiles <ATen/ATen.h> once as a precompiled header (cmake/tandem.cmake,
// tandem_precompile_torch); this file is its one source, and its object is linked into nothing.

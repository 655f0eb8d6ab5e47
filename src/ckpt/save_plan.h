// SavePlan: how one SaveRequest becomes two files, cut into aligned write pieces. Internal to
// the writer; exposed for tests.
//
// Each file is its safetensors header (padded to a multiple of kFileAlign) followed by its
// tensors back to back, ordered by (region, offset). The file is cut into pieces of at most
// `piece_bytes`, at kFileAlign multiples; a piece also ends where a run of tensors from one
// region begins at an aligned file offset, so that a run whose memory is aligned the same way
// is written in place ("direct"). Other pieces go through a staging buffer. The last piece of
// a file is padded to kFileAlign (the file is truncated to its size afterwards).
//
// Value type; the plan borrows the regions' memory through raw pointers and owns the headers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ckpt/writer.h"

namespace strata::ckpt {

// Bytes of a piece taken from one place: a region (region >= 0) or a header (region == -1;
// `data` is null, see source_data).
struct PieceSource {
  const char* data = nullptr;   // null for a header and for a region read through its reader
  uint64_t length = 0;
  uint64_t dst = 0;             // offset within the piece
  int region = -1;
  uint64_t region_offset = 0;
};

struct Piece {
  int file = 0;                 // index into SavePlan::files
  uint64_t offset = 0;          // file offset, a multiple of kFileAlign
  uint64_t length = 0;          // a multiple of kFileAlign
  uint64_t real = 0;            // bytes inside the file's size (the rest is padding)
  bool direct = false;          // one aligned source covering the whole piece
  std::vector<PieceSource> sources;  // tile [0, real) in order
};

struct PlannedFile {
  std::string name;             // kModelFile or kOptimizerFile
  std::string header;           // the first data_start bytes
  uint64_t data_start = 0;
  uint64_t size = 0;            // exact file size
  int first_piece = 0;          // pieces [first_piece, end_piece) belong to this file
  int end_piece = 0;
  uint64_t tensor_count = 0;
  std::vector<HeaderEntry> tensors;  // as in the header: offsets from data_start, in file order
};

// A byte range of a region and the piece that writes it.
struct RegionSpan {
  uint64_t begin = 0;
  uint64_t end = 0;
  int piece = 0;
};

struct SavePlan {
  std::vector<PlannedFile> files;  // [0] model, [1] optimizer
  std::vector<Piece> pieces;       // file by file, each in offset order
  std::vector<std::vector<RegionSpan>> region_spans;  // per region, sorted, disjoint
};

// Where a source's bytes are: in its region, or in the plan's copy of the file header.
inline const char* source_data(const SavePlan& plan, const Piece& piece, const PieceSource& source) {
  return source.region < 0 ? plan.files[piece.file].header.data() + piece.offset + source.dst : source.data;
}

// Validates the request's tensors (InvalidArgument naming the tensor: out of its region,
// overlapping another, a duplicate name, a null region) and plans the files.
Result<SavePlan> make_save_plan(const SaveRequest& request, uint64_t piece_bytes);

// The staging piece size for a budget: a quarter of it, a multiple of kFileAlign, at most 8 MiB.
uint64_t piece_bytes_for_staging(uint64_t staging_bytes);

}  // namespace strata::ckpt

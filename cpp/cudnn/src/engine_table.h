// Engine tables: the engine chosen for each convolution, one choice per line
// ("key<TAB>fused<TAB>heuristic mode<TAB>position"), shipped per GPU and appended by a run as it tunes.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "conv.h"

namespace rung {

// Every choice of the tables at `paths`; later files win.
std::map<std::string, EngineChoice> read_engine_tables(const std::vector<std::string>& paths);

// One line per write, appended to `path` (none where empty): a later process of the run reuses the choice.
void append_engine_choice(const std::string& path, const std::string& key, const EngineChoice& c);

}  // namespace rung

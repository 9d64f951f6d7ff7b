#include "engine_table.h"

#include <fstream>
#include <sstream>

namespace rung {

std::map<std::string, EngineChoice> read_engine_tables(const std::vector<std::string>& paths) {
  std::map<std::string, EngineChoice> table;
  for (const std::string& path : paths) {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string key;
      EngineChoice c{};
      int fused = 0;
      if (std::getline(fields, key, '\t') && fields >> fused >> c.heur_mode >> c.heur_index) {
        c.fused = fused != 0;
        table[key] = c;
      }
    }
  }
  return table;
}

void append_engine_choice(const std::string& path, const std::string& key, const EngineChoice& c) {
  if (path.empty()) return;
  std::ofstream(path, std::ios::app) << key << '\t' << int(c.fused) << '\t' << c.heur_mode << '\t' << c.heur_index
                                     << '\n' << std::flush;
}

}  // namespace rung

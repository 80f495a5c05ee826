#include "kvq/core/json_text.h"

#include <gtest/gtest.h>

#include <string>

#include "kvq/core/error.h"
#include "support/fixtures.h"

namespace kvq {
namespace {

std::string refusal(std::string_view text) {
  try {
    parse_json_text(text, "where/config.json");
  } catch (const InputError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("WRONG EXCEPTION: ") + e.what();
  }
  return "accepted";
}

// Every failure of the JSON parser is an InputError naming the origin (the fuzz targets found a
// number overflow escaping as nlohmann's out_of_range where only parse_error was caught).
TEST(JsonText, EveryParserFailureIsAnInputErrorNamingTheOrigin) {
  for (const char* bad :
       {"", "{", "[1, 2", "{\"a\": 1e99999}", "[-2e400]", "{\"a\": tru}", "\"\\ud800\"", "{} x"}) {
    const std::string msg = refusal(bad);
    EXPECT_EQ(msg.rfind("where/config.json: not valid JSON (", 0), 0u) << bad << " -> " << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
  EXPECT_EQ(parse_json_text(R"({"a": [1, 2.5e300, "x"]})", "t")["a"][1], 2.5e300);
}

TEST(JsonText, FilesAreReadThenParsed) {
  const std::string dir = test::fresh_dir("json");
  try {
    parse_json_file(dir + "/missing.json");
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("missing.json: cannot be read"), std::string::npos);
  }
  test::write_text(dir + "/ok.json", R"({"k": 3})");
  EXPECT_EQ(parse_json_file(dir + "/ok.json")["k"], 3);
  test::write_text(dir + "/big.json", R"({"k": 3e999})");
  EXPECT_THROW(parse_json_file(dir + "/big.json"), InputError);
}

}  // namespace
}  // namespace kvq

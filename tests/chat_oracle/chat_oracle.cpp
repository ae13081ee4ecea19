// The pinned llama.cpp's chat layer as an oracle for muse_mlx/chat_format.py (tests/chat_oracle.py
// builds it from the pinned sdist's common/ sources). One JSON request on stdin:
//   {"template", "bos", "eos", "messages", "tools"?, "tool_choice"?, "parallel_tool_calls"?,
//    "reasoning_format"?, "add_generation_prompt"?, "continue_final_message"?, "chat_template_kwargs"?,
//    "parse"?: [texts]}
// and one JSON answer on stdout: llama.cpp's prompt, grammar, lazy flag, triggers, preserved tokens,
// generation prompt, and for each text to parse the message its parser makes (or {"error": ...}).
#include "chat.h"

#include <nlohmann/json.hpp>

#include <iostream>
#include <sstream>

using json = nlohmann::ordered_json;

static common_json to_common(const json & j) { return common_json::parse(j.dump()); }

int main() {
    try {
        std::stringstream in;
        in << std::cin.rdbuf();
        const json req = json::parse(in.str());
        auto tmpls = common_chat_templates_init(nullptr, req.at("template").get<std::string>(),
                                                req.value("bos", std::string()), req.value("eos", std::string()));
        common_chat_templates_inputs inputs;
        inputs.messages = common_chat_msgs_parse_oaicompat(to_common(req.at("messages")));
        if (req.contains("tools")) {
            inputs.tools = common_chat_tools_parse_oaicompat(to_common(req.at("tools")));
        }
        inputs.tool_choice = common_chat_tool_choice_parse_oaicompat(req.value("tool_choice", std::string("auto")));
        inputs.parallel_tool_calls = req.value("parallel_tool_calls", false);
        inputs.reasoning_format = common_reasoning_format_from_name(req.value("reasoning_format", std::string("auto")));
        inputs.add_generation_prompt = req.value("add_generation_prompt", true);
        if (req.contains("continue_final_message")) {
            inputs.continue_final_message = common_chat_continuation_parse(to_common(req.at("continue_final_message")));
        }
        if (req.contains("chat_template_kwargs")) {
            for (const auto & item : req.at("chat_template_kwargs").items()) {
                inputs.chat_template_kwargs[item.key()] = item.value().dump();
            }
        }
        const auto params = common_chat_templates_apply(tmpls.get(), inputs);
        json out;
        out["prompt"] = params.prompt;
        out["grammar"] = params.grammar;
        out["grammar_lazy"] = params.grammar_lazy;
        json triggers = json::array();
        for (const auto & t : params.grammar_triggers) {
            triggers.push_back({{"type", static_cast<int>(t.type)}, {"value", t.value}});
        }
        out["triggers"] = triggers;
        out["preserved_tokens"] = params.preserved_tokens;
        out["generation_prompt"] = params.generation_prompt;
        json parsed = json::array();
        if (req.contains("parse")) {
            common_chat_parser_params parser(params);
            parser.reasoning_format = inputs.reasoning_format;
            parser.parser.load(params.parser);
            for (const auto & text : req.at("parse")) {
                try {
                    parsed.push_back(json::parse(common_chat_parse(text.get<std::string>(), false, parser)
                                                     .to_json_oaicompat().dump()));
                } catch (const std::exception & e) {
                    parsed.push_back({{"error", e.what()}});
                }
            }
        }
        out["parsed"] = parsed;
        std::cout << out.dump() << std::endl;
        return 0;
    } catch (const std::exception & e) {
        std::cout << json({{"fatal", e.what()}}).dump() << std::endl;
        return 1;
    }
}
